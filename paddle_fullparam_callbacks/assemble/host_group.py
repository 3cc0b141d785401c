"""Collectives over host memory: the export's own communication.

An export moves host bytes (slices packed into buffers) and small Python objects (plans, decisions,
checksums). It does so over process groups made for the export (gloo, created at the start of the
job: ``trainer/host_groups.py``), never through the training's device communicator (NCCL, XCCL):
the device communicator would need the bytes in device memory, and its streams belong to training.
A ``HostGroup`` wraps one such process group and works on numpy arrays, which Paddle sees as CPU
tensors over the same memory (DLPack): nothing is allocated on any device, nothing is copied on
the way in or out.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, List, Sequence

import numpy as np


_ARRIVALS = "paddle_fullparam/arrivals"


def _arrive(store, key: str, target: int) -> None:
    """Count this member in at ``key`` and return once the count reaches ``target``. Polls (a wait inside
    the store would be bound by the store's timeout): every 1 ms for the first 50 ms, as the peers of a
    transfer usually arrive within a packet's time of each other, then backing off to 10 ms."""
    count, delay, waited = store.add(key, 1), 1e-4, 0.0
    while count < target:
        time.sleep(delay)
        waited += delay
        delay = min(2 * delay, 1e-3 if waited < 0.05 else 0.01)
        count = store.add(key, 0)


def _tensor(arr: np.ndarray):
    import paddle

    return paddle.from_dlpack(arr)


class HostGroup:
    """A process group over host memory. ``ranks``: the global ranks of its members, in group order;
    ``rank``: this process's global rank (a member); ``store``: the group's own TCP store.

    Every collective first waits, through the store, until every member has reached it: a gloo
    operation gives up after 30 s (gloo's default timeout, which Paddle 3.3.1 does not let a caller
    set: ``ProcessGroupGloo.create`` takes none), and a member may well be that late (its writer
    waiting for a slow disk, its trainer saving a checkpoint before an event). Waiting in the store
    has no such limit; how long a rank may wait is ``export.timeout_s``'s to decide (the watchdog)."""

    def __init__(self, pg, ranks: Sequence[int], rank: int, store=None):
        self.pg = pg
        self.ranks = list(ranks)
        self.rank = rank
        self.index = self.ranks.index(rank)
        self.store = store
        self._arrivals = 0  # collectives this member has started: the same sequence on every member
        self._pairs: dict = {}  # (src, dst) -> point-to-point transfers between them so far

    def ready(self) -> None:
        """Return once every member has reached its ``ready()`` of the same number. One counter in the
        store, so nothing accumulates there; the last to arrive does not wait at all."""
        if self.store is None:
            return
        self._arrivals += 1
        _arrive(self.store, _ARRIVALS, self._arrivals * self.size)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"HostGroup(ranks={self.ranks})"

    def all_gather(self, buf: np.ndarray) -> np.ndarray:
        """Every member's ``buf`` (1-D uint8, the same length everywhere): ``[size, len]`` uint8."""
        buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        out = np.empty((self.size, buf.nbytes), dtype=np.uint8)
        if buf.nbytes:
            self.ready()
            self.pg.all_gather_into_tensor(_tensor(out.reshape(-1)), _tensor(buf), True).wait()
        return out

    def broadcast(self, buf: np.ndarray, src: int) -> None:
        """``buf`` (1-D uint8, writable, C-contiguous) of global rank ``src`` into every member's ``buf``."""
        if buf.nbytes:
            self.ready()
            self.pg.broadcast(_tensor(buf), self.ranks.index(src), True).wait()

    def _pair_ready(self, src: int, dst: int) -> None:
        """``ready()`` for the two ends of one point-to-point transfer (``src`` -> ``dst``, global ranks):
        a counter per ordered pair, so the members not involved never wait."""
        if self.store is None:
            return
        key = f"{_ARRIVALS}/{src}-{dst}"
        seq = self._pairs[(src, dst)] = self._pairs.get((src, dst), 0) + 1
        _arrive(self.store, key, 2 * seq)

    def send(self, buf: np.ndarray, dst: int) -> None:
        """``buf`` (1-D uint8, C-contiguous) to global rank ``dst``, which calls ``recv`` with a buffer of the
        same size. Blocks until ``dst`` has received it (gloo's send waits for the receiver)."""
        if buf.nbytes:
            if not buf.flags.writeable:  # DLPack cannot carry a read-only flag (a CPU parameter's memory may be one)
                buf = buf.copy()
            self._pair_ready(self.rank, dst)
            self.pg.send(_tensor(buf), self.ranks.index(dst), True).wait()

    def recv(self, buf: np.ndarray, src: int) -> None:
        """Into ``buf`` (1-D uint8, writable, C-contiguous) the bytes global rank ``src`` sends."""
        if buf.nbytes:
            self._pair_ready(src, self.rank)
            self.pg.recv(_tensor(buf), self.ranks.index(src), True).wait()

    def all_gather_object(self, obj: Any) -> List[Any]:
        """Every member's ``obj`` (picklable), in group order."""
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        sizes = self.all_gather(np.array([data.nbytes], dtype=np.int64).view(np.uint8)).view(np.int64).reshape(-1)
        width = int(sizes.max())
        buf = np.zeros(width, dtype=np.uint8)
        buf[:data.nbytes] = data
        got = self.all_gather(buf)
        return [pickle.loads(got[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]

    def barrier(self) -> None:
        self.all_gather(np.zeros(1, dtype=np.uint8))
