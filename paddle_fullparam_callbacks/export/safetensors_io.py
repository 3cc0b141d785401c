"""Streaming safetensors writing and bounds-checked header reading.

The writer carries out an :class:`ExportPlan`: each file's header is known in advance, each
tensor's bytes go to their planned offset as they arrive, and the SHA-256 of a file is computed
on the way when tensors arrive in file order (the usual case), or by one read-back otherwise.
A background thread does the disk writes (and another the hashing) so that assembly, I/O and
SHA-256 overlap; the bytes it holds for tensors not yet on disk never exceed
``max_pending_bytes`` (one tensor larger than that is let through alone).
"""
from __future__ import annotations

import json
import math
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from .. import _dtypes
from . import checksum
from ..plan.export_plan import ExportPlan, ShardFile, TensorSlot
from .. import _faults
from .commit import fsync_dir

_MAX_HEADER = 100 * 2**20  # same bound as the safetensors library


class SafetensorsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class FileResult:
    name: str
    bytes: int
    digest: str  # checksum.DEFAULT of the whole file


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n




_BLOCK_BYTES = 8 * 2**20


def _contiguous_blocks(array: np.ndarray):
    """Yield C-contiguous pieces of ``array`` in row-major order, each about 8 MB at most."""
    if array.flags.c_contiguous or array.ndim == 0:
        yield array
        return
    row_bytes = max(1, array[0].nbytes if len(array) else 1)
    rows = max(1, _BLOCK_BYTES // row_bytes)
    for r in range(0, len(array), rows):
        yield np.ascontiguousarray(array[r:r + rows])


class _QueueWorker:
    """A daemon thread that handles queued items in order; ``wait()`` returns once all are done."""

    def __init__(self, name: str, maxsize: int = 0):
        self._queue: "queue.Queue" = queue.Queue(maxsize=maxsize)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _handle(self, item) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._handle(item)
            except BaseException as e:  # surfaced by the owner (see drain)
                self._error = e
            finally:
                self._queue.task_done()


class _Hasher(_QueueWorker):
    """The checksum (``checksum.DEFAULT``) on a thread of its own, fed in order: hashing overlaps
    the disk writes. Both hashers release the GIL on large buffers, so on two cores this runs
    beside ``pwrite``.
    At most ``max_blocks`` blocks wait (each at most a tensor view or an 8 MB copy).
    """

    def __init__(self, max_blocks: int = 4):
        super().__init__("pfc-hash", maxsize=max_blocks)

    def update(self, h, buf) -> None:
        self._queue.put((h, buf))

    def after(self, fn) -> None:
        """Call ``fn`` once every update queued so far is applied (its buffers may then be reused)."""
        self._queue.put((None, fn))

    def drain(self) -> None:
        """Wait until every queued update is applied."""
        self.wait()
        if self._error is not None:
            raise self._error

    def _handle(self, item) -> None:
        h, payload = item
        if h is None:
            payload()
        elif self._error is None:
            h.update(payload)


class _InlineHasher:
    """The same interface, hashing on the caller's thread (for background=False)."""

    def update(self, h, buf) -> None:
        h.update(buf)

    def after(self, fn) -> None:
        fn()

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Flusher(_QueueWorker):
    """Starts writeback early: ``fdatasync`` of a file every ``every`` bytes, on its own thread.

    Without it the kernel may hold all of a snapshot's dirty pages until the final fsync (here
    it starts writing back only at 2.4 GB), which then pays the whole disk time after the CPU
    work instead of beside it.
    """

    def __init__(self, every: int = 64 * 2**20):
        super().__init__("pfc-flush")
        self.every = every

    def request(self, fd: int) -> None:
        self._queue.put(fd)

    def _handle(self, fd) -> None:
        try:
            os.fdatasync(fd)
        except OSError:
            pass  # the final fsync reports real errors


class _NoFlusher:
    every = 1 << 62

    def request(self, fd: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class _FileState:
    """One file being written: the sequential cursor, the hash, and the slots still missing."""

    def __init__(self, directory: Path, spec: ShardFile, hasher, flusher):
        self.spec = spec
        self.hasher = hasher
        self.flusher = flusher
        self.unflushed = 0
        self.path = directory / spec.name
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.base = len(spec.header)
        self.hash = checksum.new(checksum.DEFAULT, spec.header)
        _pwrite_all(self.fd, memoryview(spec.header), 0)
        self.order = sorted(spec.slots, key=lambda s: s.begin)
        self.next_slot = 0  # index into order of the first slot not yet hashed in sequence
        self.written: set = set()
        self.stash: dict = {}  # slot name -> buffer waiting for its turn
        self.rehash = False

    @property
    def done(self) -> bool:
        return len(self.written) == len(self.order)

    def write(self, slot: TensorSlot, array: np.ndarray, hash_it: bool, release=None) -> None:
        """Write ``array`` at its slot; a strided view (e.g. a transpose) is copied block by block."""
        offset = self.base + slot.begin
        for block in _contiguous_blocks(array):
            _faults.point("block")
            buf = _dtypes.as_bytes_view(block)
            _pwrite_all(self.fd, buf, offset)
            if hash_it:
                self.hasher.update(self.hash, buf)
            offset += len(buf)
            self.unflushed += len(buf)
            if self.unflushed >= self.flusher.every:
                self.flusher.request(self.fd)
                self.unflushed = 0
        self.written.add(slot.name)
        if release is not None:  # the producer may reuse the array's memory once it is hashed
            self.hasher.after(release) if hash_it else release()

    def finish(self) -> FileResult:
        self.flusher.wait()  # no early flush may still use the fd
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        self.hasher.drain()
        digest = checksum.digest_of_file(self.path) if self.rehash else self.hash.hexdigest()
        return FileResult(self.spec.name, self.spec.total_bytes, digest)

    def close_quietly(self) -> None:
        self.flusher.wait()
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1


class SnapshotWriter:
    """Writes the files of ``plan`` listed in ``file_indices`` into ``directory``.

    ``put(name, array)`` hands over one tensor (a numpy array of the planned dtype storage and
    shape; a strided view such as a transpose is fine and is copied in 8 MB blocks); ``close()`` waits for the disk, fsyncs and returns a :class:`FileResult` per file;
    ``abort()`` stops and removes this writer's files. The array must not change until close().
    """

    def __init__(
        self,
        plan: ExportPlan,
        directory: "str | os.PathLike",
        file_indices: Optional[Iterable[int]] = None,
        max_pending_bytes: int = 512 * 2**20,
        background: bool = True,
    ):
        self.plan = plan
        self.directory = Path(directory)
        indices = range(len(plan.files)) if file_indices is None else file_indices
        self.files = {i: plan.files[i] for i in sorted(set(indices))}
        self.budget = max(1, int(max_pending_bytes))
        self._states: dict = {}
        self._results: dict = {}
        self._received: set = set()
        self._error: Optional[BaseException] = None
        self._aborted = False
        self._cv = threading.Condition()
        self._queued_bytes = 0
        self._stash_bytes = 0
        self.peak_pending_bytes = 0
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = None
        self._hasher = _Hasher() if background else _InlineHasher()
        self._flusher = _Flusher() if background else _NoFlusher()
        if background:
            self._thread = threading.Thread(target=self._run, name="pfc-writer", daemon=True)
            self._thread.start()

    # ---- producer side -------------------------------------------------------------------
    def wants(self, name: str) -> bool:
        slot = self.plan.slots.get(name)
        return slot is not None and slot.file_index in self.files

    def put(self, name: str, array: np.ndarray, release=None) -> None:
        """Hand over one tensor; ``release()`` is called once its bytes are written and hashed."""
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
        self._received.add(name)
        if self._thread is None:
            self._accept(slot, array, release)
            return
        n = array.nbytes
        with self._cv:
            # half the budget for the queue, half for out-of-order tensors waiting in a stash
            while self._queued_bytes and self._queued_bytes + n > self.budget // 2 and self._error is None:
                # (a tensor larger than the budget waits for an empty queue, then goes alone)
                self._cv.wait()
            self._queued_bytes += n
            self._note_peak()
        self._queue.put((slot, array, release))

    def close(self) -> dict:
        """Wait for all bytes, fsync every file, return {file name: FileResult}."""
        missing = [s.name for i in self.files for s in self.files[i].slots if s.name not in self._received]
        if missing:
            self.abort()
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(f"export incomplete: no data for tensor(s) {missing[:5]}{more}")
        self._stop_thread()
        self._raise_if_failed()
        for i, spec in self.files.items():
            if i not in self._results:
                state = self._state(i)
                self._drain_stash(state)
                self._results[i] = state.finish()
        self._hasher.close()
        self._flusher.close()
        fsync_dir(self.directory)
        return {r.name: r for r in self._results.values()}

    def abort(self) -> None:
        self._aborted = True
        self._stop_thread()
        self._hasher.close()
        for state in self._states.values():
            state.close_quietly()
        self._flusher.close()
        for spec in self.files.values():
            try:
                (self.directory / spec.name).unlink()
            except FileNotFoundError:
                pass

    # ---- writer side ---------------------------------------------------------------------
    def _note_peak(self) -> None:
        self.peak_pending_bytes = max(self.peak_pending_bytes, self._queued_bytes + self._stash_bytes)

    def _state(self, index: int) -> _FileState:
        st = self._states.get(index)
        if st is None:
            st = self._states[index] = _FileState(self.directory, self.files[index], self._hasher, self._flusher)
        return st

    def _accept(self, slot: TensorSlot, array: np.ndarray, release=None) -> None:
        st = self._state(slot.file_index)
        expected = st.order[st.next_slot] if st.next_slot < len(st.order) else None
        if expected is not None and expected.name == slot.name:
            st.write(slot, array, hash_it=not st.rehash, release=release)
            st.next_slot += 1
            self._drain_stash(st)
        elif self._stash_bytes + array.nbytes <= self.budget // 2:
            st.stash[slot.name] = (array, release)
            with self._cv:
                self._stash_bytes += array.nbytes
                self._note_peak()
        else:
            st.write(slot, array, hash_it=False, release=release)  # out of order, no room: hash redone at the end
            st.rehash = True
        if st.done and not st.stash and slot.file_index not in self._results:
            self._drain_stash(st)
            self._results[slot.file_index] = st.finish()

    def _drain_stash(self, st: _FileState) -> None:
        while st.next_slot < len(st.order):
            s = st.order[st.next_slot]
            held = st.stash.pop(s.name, None)
            if held is not None:
                array, release = held
                st.write(s, array, hash_it=not st.rehash, release=release)
                with self._cv:
                    self._stash_bytes -= array.nbytes
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
            slot, array, release = item
            try:
                if self._error is None and not self._aborted:
                    self._accept(slot, array, release)
            except BaseException as e:  # reported to the producer on its next call
                self._error = e
            finally:
                with self._cv:
                    self._queued_bytes -= array.nbytes
                    self._cv.notify_all()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OSError(f"writing the snapshot failed: {self._error}") from self._error


# ---- reading --------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # safetensors code
    shape: tuple
    begin: int
    end: int


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"duplicate key {short(k)}")
        out[k] = v
    return out


def _no_constant(token):
    raise ValueError(f"{token} is not JSON")


def parse_json_strict(data: bytes):
    """Parse UTF-8 JSON bytes, refusing what ``json.loads`` would let through or crash on.

    Raises ValueError with a reason to print after the file name: not UTF-8, not valid JSON
    (NaN and Infinity included), a duplicate key (the two readers of a file could disagree on
    its value), nested too deeply (``RecursionError`` otherwise).

    >>> parse_json_strict(b'{"a": [1, 2]}')
    {'a': [1, 2]}
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise ValueError(f"has a {e}") from e
    except RecursionError as e:
        raise ValueError("is not valid JSON (nested too deeply)") from e
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e})") from e


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: names and values in messages come from the files."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(fname: str, name: str, e) -> HeaderEntry:
    """One checked header entry; raises SafetensorsFormatError naming the file and the tensor."""
    where = f"{fname}: tensor {short(name)}"
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise SafetensorsFormatError(f"{where} has a malformed header entry {short(e)}")
    code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(code, str) or code not in _dtypes.BY_ST_CODE:
        raise SafetensorsFormatError(f"{where} has unknown dtype {short(code)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsFormatError(f"{where} has invalid shape {short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise SafetensorsFormatError(f"{where} has invalid offsets {short(offsets)}")
    begin, end = offsets
    expected = math.prod(shape) * _dtypes.BY_ST_CODE[code].itemsize
    if end - begin != expected:
        raise SafetensorsFormatError(
            f"{where} spans {end - begin} bytes, its shape {list(shape)} of {code} needs {expected}")
    return HeaderEntry(name, code, tuple(shape), begin, end)


def _check_layout(fname: str, entries: dict, data_start: int, size: int) -> None:
    """The tensors tile the data area exactly: no overlap, no gap, nothing past the end or after it."""
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < cursor:
            raise SafetensorsFormatError(f"{fname}: tensor {short(e.name)} overlaps the tensor before it")
        if e.begin > cursor:
            raise SafetensorsFormatError(f"{fname}: a gap of {e.begin - cursor} bytes lies before tensor {short(e.name)}")
        cursor = e.end
    if data_start + cursor > size:
        last = max(entries.values(), key=lambda e: e.end).name if entries else "?"
        raise SafetensorsFormatError(
            f"{fname}: tensor {short(last)} runs past the end of the file ({data_start + cursor} > {size} bytes; truncated?)"
        )
    if data_start + cursor < size:
        raise SafetensorsFormatError(f"{fname}: {size - data_start - cursor} trailing bytes after the last tensor")


def parse_header(f, fname: str) -> tuple:
    """:func:`read_header` of an open binary file (read from its start); ``fname`` names it in messages."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    raw = f.read(8)
    if len(raw) < 8:
        raise SafetensorsFormatError(f"{fname}: file is {size} bytes, too short for a header")
    n = int.from_bytes(raw, "little")
    if n > _MAX_HEADER:
        raise SafetensorsFormatError(f"{fname}: header length {n} is over the limit of {_MAX_HEADER} bytes")
    if 8 + n > size:
        raise SafetensorsFormatError(f"{fname}: header length {n} runs past the file ({size} bytes)")
    text = f.read(n)
    if len(text) < n:
        raise SafetensorsFormatError(f"{fname}: the file shrank while it was read")
    try:
        obj = parse_json_strict(text)
    except ValueError as e:
        raise SafetensorsFormatError(f"{fname}: header {e}") from e
    if not isinstance(obj, dict):
        raise SafetensorsFormatError(f"{fname}: header is not a JSON object")
    metadata = obj.pop("__metadata__", None)
    entries = {name: _entry(fname, name, e) for name, e in obj.items()}
    _check_layout(fname, entries, 8 + n, size)
    return metadata, entries, 8 + n


def _open_regular(path: Path):
    """Open ``path`` for reading; refuse a directory, FIFO or device (O_NONBLOCK: a FIFO cannot block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SafetensorsFormatError(f"{path.name}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: "str | os.PathLike") -> tuple:
    """Parse and bounds-check a safetensors header. Returns (metadata, {name: HeaderEntry}, data_start).

    Raises SafetensorsFormatError naming the file and the tensor at fault (OSError if it cannot be opened).
    """
    path = Path(path)
    with _open_regular(path) as f:
        return parse_header(f, path.name)


def read_tensor(path: "str | os.PathLike", name: str) -> np.ndarray:
    """Read one tensor as a numpy array (bfloat16 as uint16 bits)."""
    path = Path(path)
    with _open_regular(path) as f:
        _, entries, start = parse_header(f, path.name)
        e = entries[name]
        f.seek(start + e.begin)
        data = f.read(e.end - e.begin)
    if len(data) != e.end - e.begin:
        raise SafetensorsFormatError(f"{path.name}: the file shrank while tensor {short(name)} was read")
    storage = np.dtype(_dtypes.BY_ST_CODE[e.dtype].np_storage)
    return np.frombuffer(data, dtype=storage).reshape(e.shape)
