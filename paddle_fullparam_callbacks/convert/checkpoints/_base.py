"""The index of a checkpoint: which bytes of which file hold which block of each global tensor.

Nothing here reads tensor bytes except :meth:`Checkpoint.read`, which memory-maps the files a region
touches and copies only the blocks that intersect it, and ``_reads.region``, the same region as
a lazy array read block by block where it is consumed (``_reads.region``: what ``convert`` hands the writer).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ... import _dtypes


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it is; the message names the file or tensor and the cause."""


@dataclass(frozen=True)
class FileSlice:
    """One block of a global tensor, stored contiguously in one file.

    The block covers ``[global_offset, global_offset + local_shape)`` of the global tensor; its
    ``prod(local_shape) * itemsize`` bytes start at ``byte_offset`` in ``file``, in C order (Fortran
    order when ``fortran``), as numpy dtype ``storage_dtype`` ("uint16" for bfloat16).
    """

    file: Path
    global_offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    storage_dtype: str
    byte_offset: int
    fortran: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * np.dtype(self.storage_dtype).itemsize


@dataclass
class TensorInfo:
    global_shape: Tuple[int, ...]
    dtype: str  # the dtype's name in ``_dtypes`` ("float32", "bfloat16", ...)
    slices: List[FileSlice]  # tile the global tensor exactly (checked by ``check_tiling``)


def _fmt(t) -> str:
    return "[" + ", ".join(str(int(v)) for v in t) + "]"


def _where(s: FileSlice) -> str:
    return f"{_fmt(s.global_offset)}+{_fmt(s.local_shape)} in {s.file.name}"


_MAX_GRID_CELLS = 1 << 24


def check_tiling(key: str, info: TensorInfo) -> None:
    """The slices of ``key`` cover its global shape exactly once: every slice inside the tensor, no two
    overlapping, no element left out. Raises :class:`CheckpointError` naming the tensor and the slices.

    The check runs on the grid the slices' own boundaries cut the tensor into (one cell per distinct
    interval on each axis), so it costs the number of cells, not of elements.
    """
    shape = tuple(info.global_shape)
    storage = _dtypes.lookup(info.dtype).np_storage
    for s in info.slices:
        if len(s.global_offset) != len(shape) or len(s.local_shape) != len(shape):
            raise CheckpointError(f"tensor {key!r}: slice {_where(s)} has {len(s.local_shape)} dimensions, "
                                  f"the tensor {len(shape)} ({_fmt(shape)})")
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(s.global_offset, s.local_shape, shape)):
            raise CheckpointError(f"tensor {key!r}: slice {_where(s)} lies outside the global shape {_fmt(shape)}")
        if s.storage_dtype != storage:
            raise CheckpointError(f"tensor {key!r}: slice {_where(s)} is stored as {s.storage_dtype}, "
                                  f"a {info.dtype} tensor as {storage}")
    if math.prod(shape) == 0:
        return
    live = [s for s in info.slices if math.prod(s.local_shape) > 0]
    if not live:
        raise CheckpointError(f"tensor {key!r} {_fmt(shape)}: no file holds any of it")
    cuts = [np.unique(np.array([0, g] + [v for s in live for v in (s.global_offset[a], s.global_offset[a] + s.local_shape[a])],
                               dtype=np.int64)) for a, g in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > _MAX_GRID_CELLS:
        raise CheckpointError(f"tensor {key!r}: {len(live)} slices cut it into {cells} blocks, too many to check")
    owner = np.full([len(c) - 1 for c in cuts], -1, dtype=np.int64)
    for i, s in enumerate(live):
        region = tuple(slice(int(np.searchsorted(c, o)), int(np.searchsorted(c, o + n)))
                       for c, o, n in zip(cuts, s.global_offset, s.local_shape))
        cell = owner[region + (Ellipsis,)]  # a view, also of a 0-d grid
        taken = cell[cell >= 0]
        if taken.size:
            raise CheckpointError(f"tensor {key!r}: slices overlap: {_where(live[int(taken.flat[0])])} and {_where(s)}")
        cell[...] = i
    if (owner < 0).any():
        first = np.argwhere(owner < 0)[0]
        at = [int(c[j]) for c, j in zip(cuts, first)]
        raise CheckpointError(f"tensor {key!r} {_fmt(shape)}: no slice covers the block at {_fmt(at)} "
                              f"(a gap: a rank's file or slice is missing)")


def open_block_file(s: "FileSlice") -> int:
    """A read-only descriptor of the file holding block ``s``; a CheckpointError naming it if it cannot be opened."""
    try:
        return os.open(s.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{s.file}: cannot be opened: {e.strerror or e}") from e


@dataclass
class Checkpoint:
    """A trainer checkpoint directory, indexed: the model's tensors and where their bytes are."""

    path: Path
    framework: str  # "paddleformers" | "paddlenlp"
    layout: str  # "flex" | "pdparams" | "unified-safetensors" | "hf-safetensors"
    tensors: Dict[str, TensorInfo]
    config: Optional[dict]
    parallel: Dict[str, int]
    step: Optional[int]
    tokenizer_files: List[Path]
    # what the reads of its regions met (a file cut short after indexing), shared by its copies (``replace``):
    # the export reports a failed write as text, ``convert`` raises the first of these instead
    read_errors: List[CheckpointError] = field(default_factory=list, repr=False, compare=False)

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int], copy: bool = False) -> np.ndarray:
        """The region ``[offset, offset + shape)`` of tensor ``key`` as an array of its storage dtype
        (bfloat16 as uint16).

        Only the bytes of the region are read. A region inside one stored block is, unless ``copy``, a
        read-only view of the memory-mapped file (no copy; its pages are read as they are used). Otherwise
        it is a new array, filled by ``pread`` where a block's bytes land in it contiguously (no mapping:
        the page cache's pages are not held by this process) and from a mapping for the rest.

        >>> ckpt.read("model.norm.weight", [0], ckpt.tensors["model.norm.weight"].global_shape)  # doctest: +SKIP
        """
        info, offset, shape, storage = self.check_region(key, offset, shape)
        maps: Dict[Path, np.memmap] = {}
        if not copy and math.prod(shape):
            for s in info.slices:
                if all(so <= o and o + n <= so + sn for o, n, so, sn in zip(offset, shape, s.global_offset, s.local_shape)):
                    src = self._block(maps, s, storage)
                    view = src[tuple(slice(o - so, o - so + n) for o, n, so in zip(offset, shape, s.global_offset))]
                    view.flags.writeable = False
                    return view
        out = np.empty(shape, dtype=storage)
        if out.size == 0:
            return out
        try:
            for s in info.slices:
                lo = [max(o, so) for o, so in zip(offset, s.global_offset)]
                hi = [min(o + n, so + sn) for o, n, so, sn in zip(offset, shape, s.global_offset, s.local_shape)]
                if any(a >= b for a, b in zip(lo, hi)):
                    continue
                dst = out[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))]
                whole = all(a == so and b == so + sn for a, b, so, sn in zip(lo, hi, s.global_offset, s.local_shape))
                if whole and not s.fortran and dst.flags.c_contiguous:
                    self._pread(s, dst)
                else:
                    src = self._block(maps, s, storage)
                    dst[...] = src[tuple(slice(a - so, b - so) for a, b, so in zip(lo, hi, s.global_offset))]
        finally:
            maps.clear()  # the maps close when their last view goes
        return out

    def check_region(self, key: str, offset: Sequence[int], shape: Sequence[int]):
        """(the tensor's info, the region's offset and shape as ints, its storage dtype); raises for a region
        outside the tensor."""
        try:
            info = self.tensors[key]
        except KeyError:
            raise KeyError(f"checkpoint {self.path.name!r} has no tensor {key!r}") from None
        offset = tuple(int(v) for v in offset)
        shape = tuple(int(v) for v in shape)
        g = tuple(info.global_shape)
        if len(offset) != len(g) or len(shape) != len(g) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offset, shape, g)):
            raise CheckpointError(f"tensor {key!r} {_fmt(g)}: region {_fmt(offset)}+{_fmt(shape)} is outside it")
        return info, offset, shape, np.dtype(_dtypes.lookup(info.dtype).np_storage)

    @staticmethod
    def _pread(s: FileSlice, dst: np.ndarray) -> None:
        """Fill the C-contiguous ``dst`` with the block's bytes, read straight into it."""
        buf = memoryview(dst.reshape(-1).view(np.uint8))
        fd = open_block_file(s)
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], s.byte_offset + done)
                if n <= 0:
                    raise CheckpointError(f"{s.file}: the block {_where(s)} ends at byte {s.byte_offset + s.nbytes}, "
                                          f"the file ended at {s.byte_offset + done} (it changed after it was indexed?)")
                done += n
        finally:
            os.close(fd)

    @staticmethod
    def _block(maps: dict, s: FileSlice, storage: np.dtype) -> np.ndarray:
        m = maps.get(s.file)
        if m is None:
            try:
                m = maps[s.file] = np.memmap(s.file, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{s.file}: cannot be mapped: {e}") from e
        end = s.byte_offset + s.nbytes
        if end > m.size:
            raise CheckpointError(f"{s.file}: the block {_where(s)} ends at byte {end}, the file has {m.size} "
                                  f"(it changed after it was indexed?)")
        flat = m[s.byte_offset:end].view(storage)
        return flat.reshape(s.local_shape, order="F" if s.fortran else "C")
