"""A checkpoint tensor's region as a lazy array: its bytes go from the files straight into the writer's buffers.

``convert`` used to hand the writer read-only views of memory-mapped checkpoint files: every page was
then faulted in by the copy or the ``pwrite`` that touched it and stayed mapped, counted in the process's
RSS, until the tensor was written. ``pwrite`` from pages not yet mapped was the costly part: the kernel's
copy stops at each one, faults it in and starts again (0.55-0.65 s of CPU for the 673 MB benchmark
checkpoint, against 0.10-0.15 s to write the same bytes from the writer's buffers). A :class:`RegionRead`
reads nothing until the writer's worker threads ``fill`` a block of it:

* a block whose rows are contiguous runs of a C-ordered file block (a whole tensor, a row range, the
  rows of a tensor-parallel block beside its neighbours) is read with ``preadv`` into the writer's
  buffer itself: no mapping, no page of the checkpoint held by this process;
* anything else (a transposed Linear weight, whose every output block needs a column of each stored
  row; a Fortran-ordered block; runs too short for a read each) is copied from a mapping of the stored
  block that the kernel populated in one call (``MADV_POPULATE_READ``: the page-cache pages are mapped
  in a batch, not faulted one by one), shared by the blocks of one tensor and dropped once they are all
  filled (or the tensor is dropped).

Transposes (``.T``, ``transpose``) and row ranges (``rows``) stay lazy, so casts (``host.lazy.CastArray``)
and the writer's row blocks read only their own rows. ``np.asarray`` of a region (a LoRA merge's weight,
an assembly of several regions) gives a read-only view of the populated mapping where the region lies
in one stored block, else one array assembled from its blocks, kept while the region lives.

A file cut short after it was indexed is reported as :class:`CheckpointError` naming the file, the block
and where the file ended; the writer then aborts the export (nothing is committed).
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ...host.copy import copy_into
from ...host.lazy import LazyArray
from ...host.pool import while_waiting
from ._base import Checkpoint, CheckpointError, FileSlice, TensorInfo, _fmt, _where, open_block_file

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python's mmap names it from 3.13 on
_populate_works = True  # cleared the first time the kernel refuses the advice (then pages fault in as used)
_MIN_RUN_BYTES = 4096  # contiguous runs shorter than this (several per block) are copied from a mapping, not read one by one
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
GATED_BYTES = 2**20  # a mapped region this large waits for other such regions' fills in flight (see _Gate)


class _Gate:
    """At most one large (``GATED_BYTES``) mapped region is being filled at a time, so that one is mapped
    at a time.

    The writer's workers take pieces in file order, so a worker starting on the next tensor while
    another finishes the last block of the previous one would map both. It waits here instead until
    no fill of another large region is in flight: by then the previous region is usually complete and
    unmapped (:meth:`_Tensor.filled`). A thread never waits while it has a fill in flight, so the wait
    always ends; a region that is never completely filled (a padding row the writer zeroes) keeps its
    mapping until it is dropped, but no longer holds anyone up. Before it waits, a worker of the writer
    does the hash and write work that is ready (``host.pool.while_waiting``), so the wait at a tensor
    boundary mostly costs nothing. Regions under ``GATED_BYTES`` pass: two of them mapped at once are
    little memory. (With 64 MB here, the benchmark's 4-11 MB weights were mapped two at a time: 11 MB
    more peak RSS, 0.017x its checkpoint.)"""

    def __init__(self):
        self._cv = threading.Condition()
        self._busy: Dict[int, int] = {}  # id of the _Tensor -> its fills in flight

    def enter(self, t) -> None:
        helped = False
        with self._cv:
            while any(n for k, n in self._busy.items() if k != id(t)):
                if helped:
                    self._cv.wait()
                    continue
                helped = True
                self._cv.release()  # the writer's hash and write stages first, if they have work ready
                try:
                    while_waiting()
                finally:
                    self._cv.acquire()
            self._busy[id(t)] = self._busy.get(id(t), 0) + 1

    def leave(self, t) -> None:
        with self._cv:
            self._busy[id(t)] -= 1
            if not self._busy[id(t)]:
                del self._busy[id(t)]
                self._cv.notify_all()


_GATE = _Gate()


def _truncated(s: FileSlice, at: int) -> CheckpointError:
    return CheckpointError(f"{s.file}: the block {_where(s)} ends at byte {s.byte_offset + s.nbytes}, the file ended "
                           f"at {at} (it changed after it was indexed?)")


def _preadv_all(fd: int, views: List[memoryview], offset: int, s: FileSlice) -> None:
    """Fill ``views`` in order from the file bytes at ``offset`` (short reads continued)."""
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise _truncated(s, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


def _populate(m: mmap.mmap, first: int, last: int, s: FileSlice) -> None:
    """Map bytes ``[first, last)`` of ``m`` in one call (``MADV_POPULATE_READ``) instead of a fault per page."""
    global _populate_works
    if not _populate_works or last <= first:
        return
    try:
        m.madvise(MADV_POPULATE_READ, first, last - first)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel without the advice (before 5.14): pages fault in
            _populate_works = False
        else:  # EFAULT / EIO: the file no longer holds these bytes
            raise CheckpointError(f"{s.file}: the block {_where(s)} cannot be read: {e.strerror or e} "
                                  "(it changed after it was indexed?)") from e


class _Tensor:
    """What the blocks of one read share: the tensor's slices, its region, the populated mappings."""

    def __init__(self, key: str, info: TensorInfo, lo: Tuple[int, ...], hi: Tuple[int, ...], storage: np.dtype,
                 errors: Optional[list] = None):
        self.key, self.info, self.lo, self.hi, self.storage = key, info, lo, hi, storage
        self.errors = errors if errors is not None else []
        self.size = math.prod(h - l for l, h in zip(lo, hi))
        self._lock = threading.Lock()
        self._maps: Dict[int, np.ndarray] = {}  # slice index -> the block as an array over its mapping
        self._array: Optional[np.ndarray] = None
        self._building = threading.Lock()  # one thread assembles the array; the others wait for it
        self._filled = 0

    def slices(self, lo, hi):
        """(index, slice, intersection lo, hi) of every stored block that meets ``[lo, hi)``."""
        for i, s in enumerate(self.info.slices):
            ilo = tuple(max(a, o) for a, o in zip(lo, s.global_offset))
            ihi = tuple(min(b, o + n) for b, o, n in zip(hi, s.global_offset, s.local_shape))
            if all(a < b for a, b in zip(ilo, ihi)):
                yield i, s, ilo, ihi

    # ---- preadv into the destination -------------------------------------------------------------
    def pread(self, s: FileSlice, dst_flat: memoryview, dshape, dlo, slo, shape) -> bool:
        """Read the box ``shape`` at ``slo`` of block ``s`` (C order) into the box at ``dlo`` of a C-contiguous
        destination of shape ``dshape`` (``dst_flat``: its bytes), by ``preadv`` of the runs both hold
        contiguously; False, reading nothing, where those runs are too short to be worth a segment each."""
        block = s.local_shape
        if not block:  # a 0-d tensor: its one element
            dshape, dlo, slo, shape, block = (1,), (0,), (0,), (1,), (1,)
        n, item = len(shape), self.storage.itemsize
        k = max([j for j in range(n) if shape[j] != block[j] or shape[j] != dshape[j]], default=0)
        run = math.prod(shape[k:]) * item
        outer = shape[:k]
        count = math.prod(outer)
        if count > 1 and run < _MIN_RUN_BYTES:
            return False
        sstr = np.array([math.prod(block[j + 1:]) * item for j in range(k)], np.int64)
        dstr = np.array([math.prod(dshape[j + 1:]) * item for j in range(k)], np.int64)
        base_s = s.byte_offset + sum(a * math.prod(block[j + 1:]) * item for j, a in enumerate(slo))
        base_d = sum(a * math.prod(dshape[j + 1:]) * item for j, a in enumerate(dlo))
        idx = np.indices(outer, np.int64).reshape(k, -1).T if k else np.zeros((1, 0), np.int64)
        src = (base_s + idx @ sstr).tolist() if k else [base_s]
        dst = (base_d + idx @ dstr).tolist() if k else [base_d]
        fd = open_block_file(s)
        try:
            i = 0
            while i < count:  # one preadv per run of file-adjacent segments (at most IOV_MAX of them)
                j = i + 1
                while j < count and j - i < _IOV_MAX and src[j] == src[j - 1] + run:
                    j += 1
                _preadv_all(fd, [dst_flat[d:d + run] for d in dst[i:j]], src[i], s)
                i = j
        finally:
            os.close(fd)
        return True

    # ---- populated mappings ---------------------------------------------------------------------------
    def mapped(self, i: int, s: FileSlice) -> np.ndarray:
        """Block ``s`` as an array over a read-only mapping whose pages this region needs are populated.

        The thread that maps it populates it, outside the lock: another thread filling another block of
        the region meanwhile uses the mapping at once (its pages not yet populated fault in)."""
        with self._lock:
            arr = self._maps.get(i)
            if arr is not None:
                return arr
            arr, m, first, last = self._map(s)
            self._maps[i] = arr
        _populate(m, first, last, s)
        return arr

    def _map(self, s: FileSlice):
        """(the block's array over a new mapping, the mapping, the span of it this region needs)"""
        start = s.byte_offset - s.byte_offset % mmap.ALLOCATIONGRANULARITY
        length = s.byte_offset + s.nbytes - start
        try:
            with open(s.file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if s.byte_offset + s.nbytes > size:
                    raise _truncated(s, size)
                m = mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ, offset=start)
        except OSError as e:
            raise CheckpointError(f"{s.file}: cannot be mapped: {e.strerror or e}") from e
        first, last = (s.byte_offset - start + b for b in self._span(s))
        flat = np.frombuffer(m, np.uint8, s.nbytes, s.byte_offset - start).view(self.storage)
        return flat.reshape(s.local_shape, order="F" if s.fortran else "C"), m, first - first % mmap.PAGESIZE, last

    def _span(self, s: FileSlice) -> Tuple[int, int]:
        """Byte offsets in block ``s`` of the first and past the last element of this region in it."""
        ilo = [max(a, o) - o for a, o in zip(self.lo, s.global_offset)]
        ihi = [min(b, o + n) - o - 1 for b, o, n in zip(self.hi, s.global_offset, s.local_shape)]
        if not s.local_shape:
            return 0, self.storage.itemsize
        order = "F" if s.fortran else "C"
        first = int(np.ravel_multi_index(ilo, s.local_shape, order=order))
        last = int(np.ravel_multi_index(ihi, s.local_shape, order=order))
        return first * self.storage.itemsize, (last + 1) * self.storage.itemsize

    def filled(self, n: int) -> None:
        """Count elements filled; the mappings go once the whole region has been (the blocks the writer
        still fills after that, if any, map again)."""
        with self._lock:
            self._filled += n
            if self._filled >= self.size:
                self._maps.clear()

    def array(self) -> np.ndarray:
        """The region as an array: a view of the populated mapping (one block), else assembled once."""
        with self._building:
            if self._array is not None:
                return self._array
            parts = list(self.slices(self.lo, self.hi))
            if len(parts) == 1 and parts[0][2] == self.lo and parts[0][3] == self.hi:
                i, s, ilo, ihi = parts[0]
                arr = self.mapped(i, s)[tuple(slice(a - o, b - o) for a, b, o in zip(ilo, ihi, s.global_offset)) + (Ellipsis,)]
                arr.flags.writeable = False
            else:
                arr = np.empty(tuple(h - l for l, h in zip(self.lo, self.hi)), self.storage)
                RegionRead(self, self.lo, self.hi, tuple(range(len(self.lo)))).materialize(arr)
            self._array = arr
            return arr


class RegionRead(LazyArray):
    """The box ``[lo, hi)`` of a checkpoint tensor with its axes in the order ``perm``, read where it is filled."""

    def __init__(self, tensor: _Tensor, lo: Tuple[int, ...], hi: Tuple[int, ...], perm: Tuple[int, ...]):
        self._t, self._lo, self._hi, self._perm = tensor, lo, hi, perm
        self.shape = tuple(hi[a] - lo[a] for a in perm)
        self.dtype = tensor.storage

    def rows(self, r0: int, r1: int) -> "RegionRead":
        if self.ndim == 0:
            return self
        a = self._perm[0]
        if not 0 <= r0 <= r1 <= self.shape[0]:
            raise IndexError(f"rows {r0}:{r1} of a region of {self.shape[0]}")
        lo, hi = list(self._lo), list(self._hi)
        lo[a], hi[a] = self._lo[a] + r0, self._lo[a] + r1
        return RegionRead(self._t, tuple(lo), tuple(hi), self._perm)

    def transpose(self, *axes) -> "RegionRead":
        if len(axes) == 1 and not isinstance(axes[0], (int, np.integer)):
            axes = tuple(axes[0])
        axes = tuple(int(a) for a in axes) or tuple(reversed(range(self.ndim)))
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} are not a permutation of {self.ndim} axes")
        return RegionRead(self._t, self._lo, self._hi, tuple(self._perm[a] for a in axes))

    @property
    def T(self) -> "RegionRead":
        return self.transpose()

    def fill(self, out: np.ndarray) -> None:
        t, perm, n = self._t, self._perm, self.ndim
        identity = perm == tuple(range(n))
        flat = memoryview(out.reshape(-1).view(np.uint8)) if identity and out.flags.c_contiguous else None
        src_shape = tuple(h - l for l, h in zip(self._lo, self._hi))
        gated = False
        try:
            for i, s, ilo, ihi in t.slices(self._lo, self._hi):
                dlo = tuple(a - l for a, l in zip(ilo, self._lo))
                slo = tuple(a - o for a, o in zip(ilo, s.global_offset))
                box = tuple(b - a for a, b in zip(ilo, ihi))
                if flat is not None and not s.fortran and t.pread(s, flat, src_shape, dlo, slo, box):
                    continue
                if not gated and t.size * t.storage.itemsize >= GATED_BYTES:
                    _GATE.enter(t)
                    gated = True
                src = t.mapped(i, s)[tuple(slice(a, a + m) for a, m in zip(slo, box)) + (Ellipsis,)].transpose(perm)
                copy_into(out[tuple(slice(dlo[a], dlo[a] + box[a]) for a in perm) + (Ellipsis,)], src)
                del src
            t.filled(out.size)  # before the gate opens: a complete region is unmapped by then
        except CheckpointError as e:
            t.errors.append(e)
            raise
        finally:
            if gated:
                _GATE.leave(t)

    def __array__(self, dtype=None, copy=None):
        arr = self._t.array()
        arr = arr[tuple(slice(l - tl, h - tl) for l, h, tl in zip(self._lo, self._hi, self._t.lo)) + (Ellipsis,)]
        arr = arr.transpose(self._perm)
        if dtype is not None:
            return arr.astype(dtype, copy=bool(copy))
        return arr.copy() if copy else arr

    def __getitem__(self, index):
        return np.asarray(self)[index]

    def __repr__(self) -> str:
        return f"RegionRead({self._t.key!r}, {_fmt(self._lo)}..{_fmt(self._hi)}, axes {list(self._perm)})"


def region(ckpt: Checkpoint, key: str, offset: Sequence[int], shape: Sequence[int]) -> RegionRead:
    """The region ``[offset, offset + shape)`` of tensor ``key`` of ``ckpt`` as a :class:`RegionRead`: nothing is
    read until it is filled, block by block, straight into the consumer's buffers (what ``convert`` hands the
    writer); ``np.asarray`` of it gives the values. The CheckpointError a fill raises is also added to
    ``ckpt.read_errors`` (the writer reports its threads' errors as text only)."""
    info, lo, shape, storage = ckpt.check_region(key, offset, shape)
    hi = tuple(o + n for o, n in zip(lo, shape))
    return RegionRead(_Tensor(key, info, lo, hi, storage, ckpt.read_errors), lo, hi, tuple(range(len(lo))))


__all__ = ["RegionRead", "region"]
