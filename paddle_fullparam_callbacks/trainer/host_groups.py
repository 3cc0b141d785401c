"""The export's own gloo process groups (host memory), created once per process at the start of a job.

An export talks over groups of its own (``assemble/host_group.py`` says why): the world, and each
mesh's rows and columns (``TopologyPlan.export_groups``). They are gloo groups whatever the job's
device backend (NCCL, XCCL, BKCL or gloo itself), so their collectives take host memory and never
wait behind training's work on a device stream. torch's asynchronous checkpointing makes a gloo
group for the same reason.

Each group gets a TCPStore of its own for gloo's rendezvous. Why not Paddle's
``new_group(ranks, backend="gloo")``: in Paddle 3.3.1 ``ProcessGroupGloo``'s constructor runs gloo's
``connectFullMesh`` on the store it is given *without a prefix*, so every gloo group made from the
job's global store writes its peers' addresses under the same keys ("0", "1", ...): a member can
read the address of an earlier group's peer (seen as "Connection refused", a hang in
``waitUntilConnected``, or ``address.cc:30 ... 136 vs 45``; ``tests/multirank/harness.py`` has the
measurements). A fresh store per group has no earlier keys. The group's first rank serves the store
on a free port and publishes ``host:port`` in the job's global store; the other members read it
there and connect. Groups are cached for the life of the process: a second ``train()`` in the same
job reuses them.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..assemble.host_group import HostGroup

_GROUP_ID_BASE = 7_000_000  # far from Paddle's own ring ids (its comm contexts are keyed by them)
_TIMEOUT_S = 900  # to form a group (every member connects to its store); ready() polls and never waits in the store
_cache: Dict[Tuple[str, Tuple[int, ...]], HostGroup] = {}
_created = [0]  # groups this process has walked through (the same count on every rank)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_host() -> str:
    """The address the other ranks reach this one at (the launcher's endpoint for this rank)."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else ""
    return host or "127.0.0.1"


def _text(value) -> str:
    return value if isinstance(value, str) else bytes(value).decode()


def _group_store(ranks: Tuple[int, ...], rank: int, key: str):
    """A new TCPStore shared by ``ranks`` (this rank among them): served by the first, its address
    published under ``key`` in the job's global store. Returns once every member has connected."""
    from paddle.base import core
    from paddle.distributed import collective

    job_store = getattr(collective, "_default_store", None)
    if job_store is None:
        raise RuntimeError("the job has no global store (paddle.distributed.init_parallel_env() was not called): "
                           "the export cannot create its process groups")
    if rank == ranks[0]:
        host, port = _my_host(), _free_port()
        job_store.set(key, f"{host}:{port}")
        return core.TCPStore(host, port, True, len(ranks), _TIMEOUT_S)
    job_store.wait(key)
    host, port = _text(job_store.get(key)).rsplit(":", 1)
    return core.TCPStore(host, int(port), False, len(ranks), _TIMEOUT_S)


def no_delay() -> int:
    """TCP_NODELAY on every TCP socket of this process; returns how many were set.

    Paddle 3.3.1's TCPStore writes a request in several small pieces without TCP_NODELAY, so Nagle's
    algorithm holds the second piece until the first is acknowledged, and the peer delays that ACK:
    every ``add``/``get`` took 44 ms here (0.1 ms with TCP_NODELAY; ``tests/unit/test_host_groups.py``).
    The export's groups meet in their stores before every transfer, so that was 44 ms a collective or
    a packet. Set on every TCP socket (the stores' clients and the connections they accepted, gloo's
    pairs, the job's own store): it only stops small writes from waiting."""
    n = 0
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:  # not a socket: the duplicate is ours to close
            os.close(dup)
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                n += 1
        except OSError:
            pass
        finally:
            s.close()  # the duplicate only; the socket stays its owner's
    return n


def create_host_groups(groups: Sequence[Sequence[int]], rank: int, purpose: str = "") -> List[Optional[HostGroup]]:
    """One ``HostGroup`` per entry of ``groups`` (global ranks in group order), None where this rank is
    not a member or the group has one rank. Collective: every rank of the job calls it with the same
    ``groups``, in the same order. ``purpose``: groups of the same ranks for another use are other groups."""
    from paddle.base import core

    out: List[Optional[HostGroup]] = []
    for ranks in groups:
        ranks = tuple(int(r) for r in ranks)
        _created[0] += 1
        if len(ranks) < 2 or rank not in ranks:
            out.append(None)
            continue
        if (purpose, ranks) in _cache:
            out.append(_cache[(purpose, ranks)])
            continue
        store = _group_store(ranks, rank, f"paddle_fullparam/export_group/{_created[0]}")
        pg = core.ProcessGroupGloo.create(store, ranks.index(rank), len(ranks), _GROUP_ID_BASE + _created[0])
        group = HostGroup(pg, ranks, rank, store)  # (the process group needs its store for its whole life)
        _cache[(purpose, ranks)] = group
        out.append(group)
    no_delay()
    return out


@contextlib.contextmanager
def fresh_store_per_gloo_group():
    """While the block runs, every ``paddle.distributed.new_group`` call (``fleet.init`` makes a dozen)
    gets a fresh TCPStore instead of the job's global one: the same Paddle 3.3.1 defect as above, for a
    job whose own backend is gloo (CPU). Used by ``paddle-fullparam selfcheck --device cpu``; a GPU or
    custom-device job never needs it. Collective like ``new_group``: every rank of the job joins each
    store (``new_group`` is called by every rank, members or not)."""
    import paddle.distributed as dist
    from paddle.distributed import collective

    original = dist.new_group
    world = tuple(range(dist.get_world_size()))
    count = [0]

    def new_group(ranks=None, *args, **kwargs):
        count[0] += 1
        store = _group_store(world, dist.get_rank(), f"paddle_fullparam/fleet_group/{count[0]}")
        _stores.append(store)  # groups keep using their store after creation
        saved, collective._default_store = collective._default_store, store
        try:
            return original(ranks, *args, **kwargs)
        finally:
            collective._default_store = saved

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


_stores: list = []

_PAIR_ID_BASE = 7_500_000
_pairs: Dict[int, HostGroup] = {}  # peer -> this process's two-rank group with it


class PairGroups:
    """Two-rank gloo groups for the routed assembler's point-to-point transfers, one per pair of ranks that
    exchange bytes, made the first time an export's plan needs them and kept for the job.

    Why a group per pair: Paddle 3.3.1's ``ProcessGroupGloo`` tags every operation, sends and receives
    included, with a per-group counter (``next_tag()`` in ``process_group_gloo.cc``), so a send and its
    receive match only when both ranks have made the same number of operations on that group. On a group
    shared by more ranks they have not (measured with 4 ranks: a TIMEOUT in the transfer, or in the next
    all-gather); on a pair's own group every operation is a transfer between those two, in the same
    order on both. Made only among its two members (not a job-wide collective), in one global order of
    pairs that every rank derives from the plan, so the earliest pair not yet made always has both
    members waiting for it; the two meet in the job's store first, so a late member is not bound by
    gloo's 30 s connect timeout."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.groups = _pairs  # one set per process: a second session of the job reuses them (a pair is made once)

    def prepare(self, pairs: Sequence[Tuple[int, int]]) -> None:
        """Make the groups of ``pairs`` (every pair the plan uses, the same list on every rank) that include
        this rank and do not exist yet, in sorted order."""
        for a, b in sorted({(min(p), max(p)) for p in pairs}):
            if self.rank in (a, b) and a != b:
                self.get(b if self.rank == a else a)

    def get(self, peer: int) -> HostGroup:
        group = self.groups.get(peer)
        if group is None:
            from paddle.base import core
            from paddle.distributed import collective

            a, b = min(self.rank, peer), max(self.rank, peer)
            key = f"paddle_fullparam/pair/{a}-{b}"
            job_store = collective._default_store
            job_store.add(f"{key}/meet", 1)  # both members here before gloo's connect (30 s) starts
            while int(job_store.add(f"{key}/meet", 0)) < 2:
                time.sleep(0.01)
            store = _group_store((a, b), self.rank, key)
            pg = core.ProcessGroupGloo.create(store, (a, b).index(self.rank), 2, _PAIR_ID_BASE + a * self.world_size + b)
            group = self.groups[peer] = HostGroup(pg, (a, b), self.rank, store)
            no_delay()
        return group
