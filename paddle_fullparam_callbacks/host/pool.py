"""The export's worker threads: one pool per process, sized by ``export.threads``.

Transposed copies into file order, casts, LoRA merges and BLAKE3 run on these threads in blocks of a
few MB, so one large tensor keeps every thread busy. Threads (not processes) suffice because numpy's
copies and casts, ml_dtypes' casts, BLAKE3 and ``pwrite`` release the GIL while they work
(``bench/gil.py`` measures it on the machine at hand: ``bench/results/gil.json``).

The default size is the cores this rank may use: its CPU affinity (``os.sched_getaffinity``) divided
among the ranks of the job on this node (``PADDLE_LOCAL_SIZE``, which ``paddle.distributed.launch``
sets in every rank: 2 for ``--nproc_per_node 2``, per node with ``--nnodes``). A launcher that pins
each rank to cores of its own already gives each a small affinity: set ``export.threads`` there.
"""
from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Callable, List, Optional, Sequence

LOCAL_SIZE_VARS = ("PADDLE_LOCAL_SIZE", "LOCAL_WORLD_SIZE")  # Paddle's launcher; torchrun's, for mixed tooling

_local = threading.local()


def local_ranks(environ=None) -> int:
    """Ranks of this job on this node (1 outside a launcher or when the variable is unreadable).

    >>> local_ranks({"PADDLE_LOCAL_SIZE": "8"}), local_ranks({})
    (8, 1)
    """
    env = os.environ if environ is None else environ
    for var in LOCAL_SIZE_VARS:
        try:
            n = int(env.get(var, ""))
        except ValueError:
            continue
        if n >= 1:
            return n
    return 1


def usable_cores() -> int:
    """CPUs this process may run on (its affinity; the CPU count where the OS has no affinity call)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads(environ=None) -> int:
    """``export.threads: auto``: this rank's share of the cores, at least 1."""
    return max(1, usable_cores() // local_ranks(environ))


def resolve_threads(setting) -> int:
    """``export.threads`` as a number of threads: ``auto`` (or None) is :func:`default_threads`."""
    if setting is None or setting == "auto":
        return default_threads()
    return max(1, int(setting))


def in_worker() -> bool:
    """Whether the calling thread is one of a pool's workers (work it asks for then runs inline)."""
    return getattr(_local, "worker", False)


@contextlib.contextmanager
def meanwhile(fn: Callable[[], None]):
    """Within it, :func:`while_waiting` on this thread runs ``fn``: work that never waits itself (the writer's
    hash and write stages), for a task that must wait for another thread (``convert``'s mapped reads)."""
    prev = getattr(_local, "meanwhile", None)
    _local.meanwhile = fn
    try:
        yield
    finally:
        _local.meanwhile = prev


def while_waiting() -> None:
    """Run the calling thread's :func:`meanwhile` work, if it has any, before it waits."""
    fn = getattr(_local, "meanwhile", None)
    if fn is not None:
        fn()


class WorkerPool:
    """``size`` daemon threads taking tasks (callables) in submission order.

    ``submit(fn)`` queues a task that handles its own errors (the writer's pieces); ``run(fns)`` runs
    a batch and waits for it, the calling thread taking part, and raises the first error of the
    batch. A worker that calls ``run`` runs the batch inline (never waits on the queue it serves), and
    so does any caller of a one-thread pool (one thread of byte work, as configured).
    """

    def __init__(self, size: int):
        self.size = max(1, int(size))
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"pfc-work-{i}", daemon=True)
                         for i in range(self.size)]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        _local.worker = True
        while True:
            fn = self._q.get()
            if fn is None:
                return
            fn()
            fn = None  # not held while waiting: a task's arrays go once it has run

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def run(self, fns: Sequence[Callable[[], None]]) -> None:
        """Run every callable of ``fns`` (on the workers and this thread); wait; re-raise the first error."""
        fns = list(fns)
        if len(fns) <= 1 or self.size <= 1 or in_worker():
            for fn in fns:
                fn()
            return
        batch = _Batch(fns)
        for _ in range(min(self.size, len(fns) - 1)):
            self._q.put(batch.work)
        batch.work()  # the caller takes tasks too: the batch ends even if every worker is busy elsewhere
        batch.wait()

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)


class _Batch:
    """Tasks claimed one at a time by whoever calls ``work``; ``wait`` returns when all have run."""

    def __init__(self, fns: List[Callable[[], None]]):
        self.fns, self.next, self.left = fns, 0, len(fns)
        self.error: Optional[BaseException] = None
        self.cv = threading.Condition()

    def work(self) -> None:
        while True:
            with self.cv:
                if self.next >= len(self.fns):
                    return
                fn = self.fns[self.next]
                self.next += 1
            try:
                if self.error is None:
                    fn()
            except BaseException as e:  # the caller re-raises it
                self.error = self.error or e
            finally:
                with self.cv:
                    self.left -= 1
                    if not self.left:
                        self.cv.notify_all()

    def wait(self) -> None:
        with self.cv:
            while self.left:
                self.cv.wait()
        if self.error is not None:
            raise self.error


_SHARED: dict = {}  # size -> pool
_CURRENT: List[WorkerPool] = []
_SHARED_LOCK = threading.Lock()


def shared(threads) -> WorkerPool:
    """The process's pool with ``resolve_threads(threads)`` workers (made once per size, then reused:
    threads cost nothing while idle, and a rank keeps one setting for the job)."""
    n = resolve_threads(threads)
    with _SHARED_LOCK:
        pool = _SHARED.get(n)
        if pool is None:
            pool = _SHARED[n] = WorkerPool(n)
        _CURRENT[:] = [pool]
        return pool


@contextlib.contextmanager
def using(pool: WorkerPool):
    """``pool`` is :func:`current` inside the block (tests, benchmarks: a pool of a given size)."""
    with _SHARED_LOCK:
        before = list(_CURRENT)
        _CURRENT[:] = [pool]
    try:
        yield pool
    finally:
        with _SHARED_LOCK:
            _CURRENT[:] = before


def current() -> WorkerPool:
    """The pool of the export in progress (the last :func:`shared` one; ``auto`` before any)."""
    return _CURRENT[0] if _CURRENT else shared("auto")


__all__ = ["WorkerPool", "current", "default_threads", "in_worker", "local_ranks", "resolve_threads", "shared",
           "usable_cores", "using"]
