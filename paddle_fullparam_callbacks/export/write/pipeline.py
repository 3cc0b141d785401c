"""The snapshot writer's threads: pieces of tensors copied, hashed and written in file order.

A piece is a row range of one tensor at its offset in one file: a view of the producer's array
when that is contiguous, else a buffer of the :class:`BlockPool` that the prepare thread fills
with the rows in file order (``copy.copy_into``). See :class:`Pipeline` for the threads.

Once a piece is written and hashed its buffer goes back to the pool and its tensor's countdown
moves on (the tensor's ``release`` and the writer's pending-bytes budget). After an error or an
abort the threads skip the work still queued but still count every piece down, so nothing waits
forever and every buffer comes back.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import numpy as np

from .copy import copy_into
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
    (at once for a contiguous piece, after the copy for a strided one). ``done()`` runs once the
    piece is both written and prepared (copied, hashed)."""

    __slots__ = ("file", "offset", "src", "buf", "view", "ready", "left")

    def __init__(self, file, offset: int, src: np.ndarray, buf, view, done: Callable[[], None]):
        self.file, self.offset, self.src, self.buf, self.view = file, offset, src, buf, view
        self.ready = threading.Event()
        if buf is None:
            self.ready.set()
        self.left = Countdown(done, 2)  # the prepare side and the write side


class Pipeline:
    """Runs pieces on two threads (``threaded``) or on the caller's thread.

    The prepare thread takes pieces in order, copies a strided one into its buffer and hashes
    it while it is still in cache; the write thread takes them in the same order and
    writes each (``pwrite``) once its bytes are there (a contiguous piece at once). On two cores the
    two run side by side: copies and hash on one, the page-cache copy inside ``pwrite`` on the
    other. (Writes to one file do not gain from more threads: the kernel holds the file's lock
    for each write, and the waiters spin on it.) A third, mostly idle, thread starts early
    writeback and ends files (fsync) while the next file is being written.

    ``file`` objects need ``fd``, ``hash``, ``wrote(nbytes)`` (True: time to start writeback) and
    ``end(stopped)`` (fsync, close, digest; called on the file thread after the file's last piece).
    ``pwrite(fd, view, offset)`` is the caller's (tests replace it).
    """

    def __init__(self, stats: WriterStats, pwrite, on_error: Callable[[BaseException], None],
                 threaded: bool = True):
        self.stats, self._pwrite, self._on_error = stats, pwrite, on_error
        self.stopped = False
        self.threaded = self._open = threaded
        if threaded:
            self._prep_q, self._write_q, self._file_q = queue.SimpleQueue(), queue.SimpleQueue(), queue.SimpleQueue()
            self._threads = [self._start(self._prep_loop, "pfc-prepare"), self._start(self._write_loop, "pfc-write")]
            self._filer = self._start(self._file_loop, "pfc-file")

    @staticmethod
    def _start(fn, name: str) -> threading.Thread:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        return t

    # ---- the writer thread's side ------------------------------------------------------------
    def submit(self, piece: Piece, hash_it: bool) -> None:
        """Copy (if strided), hash (if ``hash_it``) and write ``piece``, in the order of submission."""
        if not self.threaded:
            self._prepare(piece, hash_it)
            self._write(piece)
            return
        self._prep_q.put((piece, hash_it))
        self._write_q.put(piece)

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
        """Wait until everything queued is done; the threads end."""
        if not self._open:
            return
        self._open = False
        self._prep_q.put(None)
        self._write_q.put(None)
        for t in self._threads:
            t.join()
        self._file_q.put(None)  # every file end is queued by now (by the last piece of the file)
        self._filer.join()

    # ---- the threads -------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> None:
        if not isinstance(e, Stopped):
            self._on_error(e)
        self.stopped = True

    def _prepare(self, piece: Piece, hash_it: bool) -> None:
        try:
            if self.stopped:
                return
            if piece.buf is not None:
                with self.stats.timed("copy_s"):
                    src = piece.src
                    copy_into(piece.buf[:src.nbytes].view(src.dtype).reshape(src.shape), src)
                piece.view = piece.buf[:src.nbytes].data
                piece.ready.set()
                self.stats.add("bytes_copied", src.nbytes)
            if hash_it:
                with self.stats.timed("hash_s"):
                    piece.file.hash.update(piece.view)
                self.stats.add("bytes_hashed", len(piece.view))
        except BaseException as e:  # reported through on_error; the piece still counts down
            self._fail(e)
        finally:
            piece.ready.set()
            self._count_down(piece)

    def _write(self, piece: Piece) -> None:
        try:
            if not piece.ready.is_set():
                with self.stats.timed("write_wait_s"):
                    piece.ready.wait()
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

    def _prep_loop(self) -> None:
        self._loop(self._prep_q, lambda item: self._prepare(*item))

    def _write_loop(self) -> None:
        self._loop(self._write_q, self._write)

    def _file_loop(self) -> None:
        self._loop(self._file_q, lambda item: (self._end if item[0] == "end" else self._writeback)(item[1]))
