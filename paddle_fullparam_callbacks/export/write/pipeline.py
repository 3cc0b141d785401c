"""The snapshot writer's threads: pieces of tensors prepared, hashed and written in file order.

A piece is a row range of one tensor at its offset in one file: a view of the producer's array
when that is contiguous, else a buffer of the :class:`BlockPool` that a worker thread fills with
the rows in file order (a transposed view copied by ``host.copy.copy_into``, a lazy array computed by
its ``fill``: a cast, a LoRA merge). See :class:`Pipeline` for the threads.

Once a piece is written and hashed its buffer goes back to the pool and its tensor's countdown
moves on (the tensor's ``release`` and the writer's pending-bytes budget). After an error or an
abort the threads skip the work still queued but still count every piece down, so nothing waits
forever and every buffer comes back.
"""
from __future__ import annotations

import collections
import queue
import threading
from typing import Callable, Optional

import numpy as np

from ...host.copy import copy_into
from ...host.lazy import LazyArray
from ...host.poison import fresh
from ...host.pool import WorkerPool, meanwhile
from .stats import WriterStats
from .syscalls import start_writeback


class Stopped(Exception):
    """The writer was aborted or one of its threads failed: stop the work in hand."""


class Countdown:
    """Calls ``fn()`` (once) when ``done()`` has been called once more than ``hold()``."""

    __slots__ = ("_n", "_fn", "_lock")

    def __init__(self, fn: Callable[[], None], n: int = 1):
        self._n, self._fn, self._lock = n, fn, threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._n += 1

    def done(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._fn()


class BlockPool:
    """At most ``count`` reusable buffers of ``size`` bytes for the copies of strided pieces.

    Reuse spares a page fault per 4 KB (a fresh 4 MB buffer per piece costs more than the copy
    into it) and bounds the copies in flight: ``get`` waits for a buffer to come back. A piece
    larger than ``size`` (one row longer than it) gets a buffer of its own, made once it is the
    only copy in flight (so the memory bound still holds, up to that one row).
    """

    def __init__(self, size: int, count: int, stopped: Callable[[], bool]):
        self.size, self.count = max(1, int(size)), max(1, int(count))
        self._stopped = stopped
        self._free: list = []
        self._out = 0  # buffers handed out and not given back
        self._made = 0
        self._cv = threading.Condition()

    def get(self, nbytes: int):
        """(a uint8 buffer of at least ``nbytes``, its give-back); raises Stopped on abort."""
        big = nbytes > self.size
        with self._cv:
            while (self._out if big else (not self._free and self._made >= self.count)) and not self._stopped():
                self._cv.wait()
            if self._stopped():
                raise Stopped()
            if big:
                buf = np.empty(nbytes, np.uint8)
            elif self._free:
                buf = self._free.pop()  # the most recently used: still in cache
            else:
                buf = np.empty(self.size, np.uint8)
                self._made += 1
            self._out += 1
        fresh(buf[:nbytes])  # (tests: the bytes this piece will use hold a pattern, not a previous piece's)
        return buf, (lambda: self._give_back(buf, big))

    def _give_back(self, buf, big: bool) -> None:
        with self._cv:
            self._out -= 1
            if not big:
                self._free.append(buf)
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()


class Piece:
    """Rows of one tensor at ``offset`` in ``file``; ``view`` (its bytes) is there once ``ready``
    (at once for a contiguous piece, once a worker filled ``buf`` otherwise). ``done()`` runs once the
    piece is both written and hashed."""

    __slots__ = ("file", "offset", "src", "buf", "view", "ready", "done", "left", "hash_it")

    def __init__(self, file, offset: int, src, buf, view, done: Callable[[], None]):
        self.file, self.offset, self.src, self.buf, self.view, self.done = file, offset, src, buf, view, done
        self.ready = threading.Event()
        if buf is None:
            self.ready.set()
        self.left: Optional[Countdown] = None  # the hash side and the write side (set by submit)
        self.hash_it = False


class _InOrder:
    """One stage (hash, write) that pieces pass in submission order, one at a time: run by whichever
    worker finds the next piece prepared, while the other workers prepare the pieces after it."""

    def __init__(self, run: Callable[[Piece], None]):
        self._run = run
        self._q: "collections.deque" = collections.deque()
        self._busy = False
        self._lock = threading.Lock()

    def add(self, piece: Piece) -> None:
        with self._lock:
            self._q.append(piece)

    def advance(self) -> None:
        """Run the stage on every piece at the head that is prepared, unless another worker is doing it
        (it will find them: a piece is marked prepared before its worker calls this)."""
        with self._lock:
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                if not self._q or not self._q[0].ready.is_set():
                    self._busy = False
                    return
                piece = self._q.popleft()
            self._run(piece)


class Pipeline:
    """Runs pieces on the worker threads of ``pool`` (and a mostly idle thread of its own), or, without
    a pool, on the caller's thread. A piece passes three stages:

    * **prepare** (any worker, as many pieces at once as there are workers): a strided piece is copied
      into file order, a lazy one computed, into its buffer; one large tensor is many pieces, so it keeps
      every worker busy;
    * **hash** (in file order: BLAKE3 is a stream) and **write** (``pwrite``, in file order: writes to one
      file do not gain from more threads, the kernel holds the file's lock for each), each run by
      whichever worker finds the next piece prepared, one piece at a time per stage, the two stages side
      by side. No thread waits for another's stage: a worker that finds nothing to hash or write takes
      the next piece to prepare, so ``export.threads`` cores are all the export uses, and all it keeps busy.

    A third, mostly idle, thread starts early writeback and ends files (fsync) while the next file is
    being written.

    ``file`` objects need ``fd``, ``hash``, ``wrote(nbytes)`` (True: time to start writeback) and
    ``end(stopped)`` (fsync, close, digest; called on the file thread after the file's last piece).
    ``pwrite(fd, view, offset)`` is the caller's (tests replace it).
    """

    def __init__(self, stats: WriterStats, pwrite, on_error: Callable[[BaseException], None],
                 pool: Optional[WorkerPool] = None):
        self.stats, self._pwrite, self._on_error = stats, pwrite, on_error
        self.stopped = False
        self._pool = pool
        self.threaded = self._open = pool is not None
        self._live = 0  # pieces submitted and not yet both hashed and written
        self._cv = threading.Condition()
        self._hashes, self._writes = _InOrder(self._hash), _InOrder(self._write)
        if self.threaded:
            self._file_q = queue.SimpleQueue()
            self._filer = self._start(self._file_loop, "pfc-file")

    @staticmethod
    def _start(fn, name: str) -> threading.Thread:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t

    # ---- the writer thread's side ------------------------------------------------------------
    def submit(self, piece: Piece, hash_it: bool) -> None:
        """Prepare (if strided or lazy), hash (if ``hash_it``) and write ``piece``, in the order of
        submission."""
        piece.hash_it = hash_it
        if not self.threaded:
            piece.left = Countdown(piece.done, 2)
            self._prepare(piece)
            self._hash(piece)
            self._write(piece)
            return
        piece.left = Countdown(lambda: self._finished(piece), 2)
        with self._cv:
            self._live += 1
        self._hashes.add(piece)
        self._writes.add(piece)
        self._pool.submit(lambda: self._work(piece))

    def end_file(self, file) -> None:
        """``file.end()`` on the file thread, behind its writeback requests."""
        if self.threaded:
            self._file_q.put(("end", file))
        else:
            self._end(file)

    def stop(self) -> None:
        """Skip the work still queued (abort or error); every piece still counts down."""
        self.stopped = True

    def close(self) -> None:
        """Wait until everything queued is done; the file thread ends."""
        if not self._open:
            return
        self._open = False
        with self._cv:  # the last pieces may still be hashing or writing on a worker
            while self._live:
                self._cv.wait()
        self._file_q.put(None)  # every file end is queued by now (by the last piece of the file)
        self._filer.join()

    # ---- the work ----------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        if not isinstance(e, Stopped):
            self._on_error(e)
        self.stopped = True

    def _prepare(self, piece: Piece) -> None:
        try:
            if self.stopped or piece.buf is None:
                return
            src = piece.src
            dst = piece.buf[:src.nbytes].view(src.dtype).reshape(src.shape)
            if isinstance(src, LazyArray):
                with self.stats.timed("fill_s"):
                    src.fill(dst)
                self.stats.add("bytes_filled", src.nbytes)
            else:
                with self.stats.timed("copy_s"):
                    copy_into(dst, src)
                self.stats.add("bytes_copied", src.nbytes)
            piece.view = piece.buf[:src.nbytes].data
        except BaseException as e:  # reported through on_error; the piece still counts down
            self._fail(e)
        finally:
            piece.src = None  # the producer's memory is not held by a piece once its bytes are copied
            piece.ready.set()

    def _work(self, piece: Piece) -> None:
        """A worker's task: prepare the piece, then take the hash and write stages as far as they go (also
        while the preparation waits for another thread: ``host.pool.while_waiting``)."""
        with meanwhile(self._advance):
            self._prepare(piece)
        self._advance()

    def _advance(self) -> None:
        self._hashes.advance()
        self._writes.advance()

    def _hash(self, piece: Piece) -> None:
        try:
            if piece.hash_it and not self.stopped:
                with self.stats.timed("hash_s"):
                    piece.file.hash.update(piece.view)
                self.stats.add("bytes_hashed", len(piece.view))
        except BaseException as e:
            self._fail(e)
        finally:
            self._count_down(piece)

    def _write(self, piece: Piece) -> None:
        try:
            if not self.stopped:
                with self.stats.timed("write_s"):
                    self._pwrite(piece.file.fd, piece.view, piece.offset)
                self.stats.add("bytes_written", len(piece.view))
                if piece.file.wrote(len(piece.view)) and self.threaded:
                    self._file_q.put(("writeback", piece.file))
        except BaseException as e:
            self._fail(e)
        finally:
            self._count_down(piece)

    def _count_down(self, piece: Piece) -> None:
        try:
            piece.left.done()  # the last side runs: the buffer, the tensor's release and budget, the file's end
        except BaseException as e:
            self._fail(e)

    def _finished(self, piece: Piece) -> None:
        try:
            piece.done()
        finally:
            # the piece and its countdown refer to each other: without this, the cycle (and the producer's
            # memory its view holds, e.g. a mapped checkpoint's pages) would wait for the garbage collector
            piece.left = piece.view = piece.buf = piece.src = piece.done = None
            with self._cv:
                self._live -= 1
                if not self._live:
                    self._cv.notify_all()

    def _end(self, file) -> None:
        try:
            file.end(self.stopped)
        except BaseException as e:
            self._fail(e)

    def _writeback(self, file) -> None:
        if self.stopped or file.fd < 0:
            return
        with self.stats.timed("writeback_s"):
            try:
                start_writeback(file.fd)
            except OSError:
                pass  # the final fsync reports real errors
        self.stats.add("writebacks", 1)

    @staticmethod
    def _loop(q, fn) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn(item)
            item = None  # not held while waiting for the next: a tensor's memory goes once it is written

    def _file_loop(self) -> None:
        self._loop(self._file_q, lambda item: (self._end if item[0] == "end" else self._writeback)(item[1]))
