"""The export's process groups' workarounds that need no job: TCP_NODELAY on the process's TCP sockets
(Paddle 3.3.1's TCPStore requests waited 44 ms each for a delayed ACK without it)."""
from __future__ import annotations

import socket

from paddle_fullparam_callbacks.trainer.host_groups import no_delay


def test_no_delay_sets_tcp_nodelay_on_every_tcp_socket_and_leaves_them_open():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for s in (client, accepted):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        assert no_delay() >= 3  # the listener, the client and the accepted end (and any other of the process)
        for s in (client, accepted):
            assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        client.sendall(b"still open")
        assert accepted.recv(16) == b"still open"
    finally:
        for s in (client, accepted, server, udp):
            s.close()


def test_no_delay_leaves_no_descriptor_behind(tmp_path):
    import os

    files = [open(tmp_path / f"f{i}", "w") for i in range(5)]  # descriptors that are not sockets
    try:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            no_delay()
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        for f in files:
            f.close()
