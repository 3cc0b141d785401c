"""Streaming safetensors writing.

The writer carries out an :class:`ExportPlan`: each file's header is known in advance, each
tensor's bytes go to their planned offset as they arrive, and the checksum of a file is computed
on the way when tensors arrive in file order (the usual case), or by one read-back otherwise.
``put`` only queues a tensor; a writer thread puts tensors in file order and cuts them into
pieces that the threads of ``pipeline`` prepare (transposed views copied into file order, lazy
arrays computed: casts, LoRA merges) on the ``export.threads`` workers, hash and write side by
side. The bytes held for tensors not yet written and hashed never exceed ``max_pending_bytes``
(one tensor larger than that is let through alone), and the buffers in flight never exceed
max(``_POOL_BLOCKS``, ``_BLOCKS_PER_THREAD`` x threads) x ``_BLOCK_BYTES``, nor, for a writer of few
bytes, 1/``_POOL_SHARE`` of its files' bytes (at least threads + 1 buffers): :func:`pool_blocks`.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from ... import _dtypes, _faults
from ...host.copy import row_blocks
from ...host.lazy import LazyArray, rows_of
from ...host.pool import shared
from ...plan.export_plan import ExportPlan, ShardFile, TensorSlot
from . import checksum
from .fsync import fsync_dir
from .pipeline import BlockPool, Countdown, Piece, Pipeline, Stopped
from .stats import WriterStats
from .order import ReceivedInOrder
from .syscalls import allocate, pwrite_all

# Sizes, read when a writer starts (module globals: the tests make them tiny).
_BLOCK_BYTES = 2 * 2**20  # a strided tensor is copied into file order in blocks of about this size
_POOL_BLOCKS = 8  # reusable buffers for those copies: at least 8 x 2 MB in flight per writer,
_BLOCKS_PER_THREAD = 3  # and 3 per worker thread (one being filled, one being hashed or written, one spare),
_POOL_SHARE = 128  # but no more than 1/128 of the bytes the writer writes (a small export holds a small pool)
_PIECE_BYTES = 16 * 2**20  # a contiguous tensor goes to pwrite (and the hash) in pieces of at most this
_WRITEBACK_EVERY = 64 * 2**20  # early writeback of a file is started every this many bytes
_ALLOCATE = True  # fallocate each file before writing it (see syscalls.allocate)


def pool_blocks(threads: int, data_bytes: int) -> int:
    """Buffers of the copy pool: max(``_POOL_BLOCKS``, ``_BLOCKS_PER_THREAD`` x threads), or fewer for a writer
    of few bytes: 1/``_POOL_SHARE`` of them, but at least one per thread and one more (each thread fills one
    while the one before is hashed and written; the convert benchmark's 673 MB keeps its speed with 3)."""
    most = max(_POOL_BLOCKS, _BLOCKS_PER_THREAD * threads)
    sized = -(-int(data_bytes) // (_POOL_SHARE * max(1, _BLOCK_BYTES)))
    return max(1, min(most, max(sized, threads + 1)))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    pwrite_all(fd, data, offset)


@dataclass(frozen=True)
class FileResult:
    name: str
    bytes: int
    digest: str  # checksum.DEFAULT of the whole file


class _FileState:
    """One file being written: the sequential cursor, the hash, and the slots still missing."""

    def __init__(self, writer: "SnapshotWriter", spec: ShardFile):
        self.spec, self.writer = spec, writer
        self.path = writer.directory / spec.name
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if writer._allocate:
                with writer.stats.timed("allocate_s"):
                    allocate(self.fd, spec.total_bytes)  # a full disk fails here (ENOSPC), before any data
            _pwrite_all(self.fd, memoryview(spec.header), 0)
        except BaseException:
            # this object never reaches the writer's states, so abort() could not close it: a file
            # unlinked while still open keeps its blocks until the process exits
            self.close_quietly()
            raise
        self.base = len(spec.header)
        self.hash = checksum.new(checksum.DEFAULT, spec.header)
        self.order = sorted(spec.slots, key=lambda s: s.begin)
        self.next_slot = 0  # index into order of the first slot not yet hashed in sequence
        self.written: set = set()
        self.stash: dict = {}  # slot name -> (array, release) waiting for its turn
        self.rehash = False
        self.finishing = False
        self.outstanding = Countdown(lambda: writer._pipeline.end_file(self))  # pieces + 1 until finish()
        self._unflushed = 0
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return len(self.written) == len(self.order)

    def wrote(self, nbytes: int) -> bool:
        """Count bytes written (I/O threads); True when early writeback is due."""
        with self._lock:
            self._unflushed += nbytes
            if self._unflushed < self.writer._writeback_every:
                return False
            self._unflushed = 0
            return True

    def write(self, slot: TensorSlot, array: np.ndarray, hash_it: bool, done, zero_row: Optional[int] = None) -> None:
        """Queue ``array``'s pieces at its slot (row ``zero_row`` as zeros); ``done()`` runs once all
        are written (and hashed)."""
        tensor = Countdown(done)
        try:
            offset = self.base + slot.begin
            if zero_row is None:
                parts = [array]
            else:  # the rows around it as they are, the row itself from a small buffer of zeros
                parts = [rows_of(array, 0, zero_row), np.zeros(array.shape[1:], array.dtype),
                         rows_of(array, zero_row + 1, len(array))]
            for part in parts:
                if part.ndim and not len(part) and part is not array:
                    continue
                offset = self._queue_pieces(part, offset, hash_it, tensor)
        finally:
            tensor.done()
        self.written.add(slot.name)

    def _queue_pieces(self, array: np.ndarray, offset: int, hash_it: bool, tensor: Countdown) -> int:
        w = self.writer
        contiguous = not isinstance(array, LazyArray) and (array.flags.c_contiguous or array.ndim == 0)
        for r0, r1 in row_blocks(array, w._piece_bytes if contiguous else w._block_bytes):
            _faults.point("block")
            w._check()
            src = rows_of(array, r0, r1)
            if contiguous:
                buf, view, give_back = None, _dtypes.as_bytes_view(src), None
            else:
                t = time.perf_counter()
                buf, give_back = w._pool.get(src.nbytes)
                w.stats.add("pool_wait_s", time.perf_counter() - t)
                view = None
            tensor.hold()
            self.outstanding.hold()
            w._pipeline.submit(Piece(self, offset, src, buf, view, _then(give_back, tensor.done, self.outstanding.done)),
                               hash_it)
            w.stats.add("blocks", 1)
            offset += src.nbytes
        return offset

    def finish(self) -> None:
        """No more pieces: the file ends (on the file thread) once the queued ones are done."""
        if not self.finishing:
            self.finishing = True
            self.outstanding.done()

    def end(self, stopped: bool) -> None:
        """fsync, close, digest (file thread); after an abort or error only close."""
        w = self.writer
        try:
            if stopped:
                return
            with w.stats.timed("fsync_s"):
                os.fsync(self.fd)
        finally:
            self.close_quietly()
        if self.rehash:
            with w.stats.timed("rehash_s"):
                digest = checksum.digest_of_file(self.path)
        else:
            digest = self.hash.hexdigest()
        w._results[self.spec.index] = FileResult(self.spec.name, self.spec.total_bytes, digest)

    def close_quietly(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _then(*fns):
    fns = [f for f in fns if f is not None]

    def run():
        for f in fns:
            f()

    return run


class SnapshotWriter:
    """Writes the files of ``plan`` listed in ``file_indices`` into ``directory``.

    ``put(name, array, release)`` hands over one tensor (a numpy array of the planned dtype
    storage and shape; a strided view such as a transpose is fine: it is copied in blocks; so is a
    ``host.lazy.LazyArray``, computed block by block on the worker threads);
    ``close()`` waits for the disk, fsyncs and returns a :class:`FileResult` per file;
    ``abort()`` stops and removes this writer's files. The array must not change until its
    ``release()`` runs (or close()). ``stats`` (a :class:`WriterStats`) says where the time went.

    With ``background`` (the default) a writer thread takes the tensors in file order and the
    threads of ``pipeline`` copy, write, hash and fsync, the byte work on the process's pool of
    ``threads`` workers (``export.threads``; None: ``auto``); without it all of that happens
    inside ``put`` and ``close`` on the caller's thread.
    """

    def __init__(
        self,
        plan: ExportPlan,
        directory: "str | os.PathLike",
        file_indices: Optional[Iterable[int]] = None,
        max_pending_bytes: int = 512 * 2**20,
        background: bool = True,
        threads=None,
    ):
        self.plan = plan
        self.directory = Path(directory)
        indices = range(len(plan.files)) if file_indices is None else file_indices
        self.files = {i: plan.files[i] for i in sorted(set(indices))}
        self.budget = max(1, int(max_pending_bytes))
        self.stats = WriterStats()
        self._t0 = time.perf_counter()
        self._block_bytes, self._piece_bytes = max(1, _BLOCK_BYTES), max(1, _PIECE_BYTES)
        self._writeback_every, self._allocate = _WRITEBACK_EVERY, _ALLOCATE
        self._states: dict = {}
        self._results: dict = {}
        self._received: set = set()
        self._in_order = ReceivedInOrder(self.files, self._received)
        self._error: Optional[BaseException] = None
        self._aborted = False
        self._cv = threading.Condition()
        self._queued_bytes = 0  # handed over, not yet written and hashed (the stash excluded)
        self._stash_bytes = 0
        self.peak_pending_bytes = 0
        workers = shared(threads) if background else None
        self.threads = workers.size if workers is not None else 1
        self._pipeline = Pipeline(self.stats, lambda fd, b, o: _pwrite_all(fd, b, o), self._fail, workers)
        blocks = pool_blocks(self.threads, sum(f.data_bytes for f in self.files.values())) if background else 1
        self._pool = BlockPool(_BLOCK_BYTES, blocks, self._stopped)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="pfc-writer", daemon=True)
            self._thread.start()

    # ---- producer side -------------------------------------------------------------------
    def wants(self, name: str) -> bool:
        slot = self.plan.slots.get(name)
        return slot is not None and slot.file_index in self.files

    def put(self, name: str, array: np.ndarray, release=None, zero_row: Optional[int] = None) -> None:
        """Hand over one tensor; ``release()`` is called once its bytes are written and hashed.
        ``zero_row``: a row (first axis) written as zeros instead of its values (an embedding's
        padding row), without a copy of the tensor."""
        self._raise_if_failed()
        slot = self.plan.slots.get(name)
        if slot is None:
            raise KeyError(f"tensor {name!r} is not in the export plan")
        if slot.file_index not in self.files:
            raise KeyError(f"tensor {name!r} belongs to {self.plan.files[slot.file_index].name}, not written here")
        if name in self._received:
            raise ValueError(f"tensor {name!r} was handed to the writer twice")
        storage = np.dtype(_dtypes.lookup(slot.dtype).np_storage)
        if array.dtype != storage or tuple(array.shape) != tuple(slot.shape):
            raise ValueError(
                f"tensor {name!r}: got {array.dtype}{list(array.shape)}, the plan says "
                f"{slot.dtype}{list(slot.shape)} (storage {storage})"
            )
        if zero_row is not None and not (array.ndim and 0 <= zero_row < len(array)):
            raise ValueError(f"tensor {name!r}: row {zero_row} to zero is not a row of {list(array.shape)}")
        self._received.add(name)
        self._in_order.note(slot)
        n = array.nbytes
        t = time.perf_counter()
        with self._cv:
            if self._thread is not None:
                # half the budget for tensors not yet written, half for out-of-order tensors in a stash
                # (a tensor larger than that waits for an empty queue, then goes alone)
                while self._queued_bytes and self._queued_bytes + n > self.budget // 2 and not self._stopped():
                    self._cv.wait()
            self._queued_bytes += n
            self._note_peak()
        self.stats.add("put_wait_s", time.perf_counter() - t)
        if self._thread is None:
            self._accept_safely(slot, array, release, zero_row)
            self._raise_if_failed()
            return
        self._queue.put((slot, array, release, zero_row))

    def will_write(self, name: str) -> bool:
        """Whether tensor ``name`` is written without more tensors handed over (``order.ReceivedInOrder``)."""
        return self._in_order.complete_through(name)

    def wait_for_room(self, nbytes: int) -> None:
        """Block until ``put`` of ``nbytes`` would not wait: for a producer that reads its next tensor
        on demand (``convert``), so that it never holds a large tensor while another is still queued."""
        if self._thread is None:
            return
        t = time.perf_counter()
        with self._cv:
            while self._queued_bytes and self._queued_bytes + nbytes > self.budget // 2 and not self._stopped():
                self._cv.wait()
        self.stats.add("put_wait_s", time.perf_counter() - t)

    def close(self) -> dict:
        """Wait for all bytes, fsync every file, return {file name: FileResult}."""
        missing = [s.name for i in self.files for s in self.files[i].slots if s.name not in self._received]
        if missing:
            self.abort()
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(f"export incomplete: no data for tensor(s) {missing[:5]}{more}")
        try:
            self._stop_thread()
            self._raise_if_failed()
            for i in self.files:
                state = self._state(i)
                if not state.finishing:
                    self._drain_stash(state)
                    state.finish()
            self._pipeline.close()
            self._raise_if_failed()
        except BaseException:
            self.abort()
            raise
        fsync_dir(self.directory)
        self.stats["elapsed_s"] = time.perf_counter() - self._t0
        return {r.name: r for _, r in sorted(self._results.items())}

    def abort(self) -> None:
        self._aborted = True
        self._pipeline.stop()
        self._pool.wake()
        with self._cv:
            self._cv.notify_all()
        self._stop_thread()
        self._pipeline.close()
        for state in self._states.values():
            state.close_quietly()
            held, state.stash = state.stash, {}
            for _, release, _ in held.values():  # the producer gets its memory back
                if release is not None:
                    release()
        for spec in self.files.values():
            try:
                (self.directory / spec.name).unlink()
            except FileNotFoundError:
                pass

    # ---- writer side ---------------------------------------------------------------------
    def _stopped(self) -> bool:
        return self._aborted or self._error is not None

    def _check(self) -> None:
        if self._stopped():
            raise Stopped()

    def _fail(self, e: BaseException) -> None:
        """The first error of any thread stops the work; put() and close() report it."""
        if self._error is None and not isinstance(e, Stopped):
            self._error = e
        self._pipeline.stop()
        self._pool.wake()
        with self._cv:
            self._cv.notify_all()

    def _note_peak(self) -> None:
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._queued_bytes + self._stash_bytes)

    def _state(self, index: int) -> _FileState:
        st = self._states.get(index)
        if st is None:
            st = self._states[index] = _FileState(self, self.files[index])
        return st

    def _done_fn(self, nbytes: int, release):
        """What runs once a tensor's bytes are written and hashed: its memory and budget come back."""

        def done():
            with self._cv:
                self._queued_bytes -= nbytes
                self._cv.notify_all()
            if release is not None:
                release()

        return done

    def _accept(self, slot: TensorSlot, array: np.ndarray, release=None, zero_row=None) -> None:
        st = self._state(slot.file_index)
        expected = st.order[st.next_slot] if st.next_slot < len(st.order) else None
        if expected is not None and expected.name == slot.name:
            st.write(slot, array, not st.rehash, self._done_fn(array.nbytes, release), zero_row)
            st.next_slot += 1
            self._drain_stash(st)
        elif self._stash_bytes + array.nbytes <= self.budget // 2:
            st.stash[slot.name] = (array, release, zero_row)
            with self._cv:  # no longer queued: waiting in the stash
                self._stash_bytes += array.nbytes
                self._queued_bytes -= array.nbytes
                self._note_peak()
                self._cv.notify_all()
        else:  # out of order, no room: written now, the checksum is redone by reading the file back
            st.rehash = True
            st.write(slot, array, False, self._done_fn(array.nbytes, release), zero_row)
        if st.done and not st.stash:
            st.finish()

    def _accept_safely(self, slot, array, release, zero_row=None) -> None:
        try:
            if self._stopped():
                self._done_fn(array.nbytes, release)()  # dropped: the budget still comes back
            else:
                self._accept(slot, array, release, zero_row)
        except BaseException as e:  # reported to the producer on its next call
            self._fail(e)

    def _drain_stash(self, st: _FileState) -> None:
        while st.next_slot < len(st.order):
            s = st.order[st.next_slot]
            held = st.stash.pop(s.name, None)
            if held is not None:
                array, release, zero_row = held
                with self._cv:  # back among the bytes not yet written
                    self._stash_bytes -= array.nbytes
                    self._queued_bytes += array.nbytes
                st.write(s, array, not st.rehash, self._done_fn(array.nbytes, release), zero_row)
            elif s.name in st.written:
                st.rehash = True
            else:
                return
            st.next_slot += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._accept_safely(*item)
            item = None  # not held while waiting for the next: the producer's memory goes once written

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OSError(f"writing the snapshot failed: {self._error}") from self._error
