"""Arrays computed block by block where they are consumed: a cast, a LoRA merge.

An assembler that would otherwise make a whole new tensor (the snapshot's dtype, a merged LoRA weight)
yields a :class:`LazyArray` instead. The snapshot writer cuts it into row blocks like any strided
tensor and each worker thread computes its block straight into a reused copy buffer, so the work is
spread over ``export.threads`` and no tensor-sized result is ever allocated (the extra memory of an
export stays the writer's buffers). Any other consumer gets the values with ``np.asarray`` (computed
in parallel, :meth:`LazyArray.materialize`).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .casts import cast_into, scratch
from .copy import row_blocks
from .pool import current

MATERIALIZE_BLOCK = 4 * 2**20  # bytes of the result per task of materialize()


class LazyArray:
    """``shape`` and ``dtype`` (numpy storage) of the values; ``fill(out)`` computes them into ``out``
    (C-contiguous, that shape and dtype); ``rows(r0, r1)`` is the lazy array of rows ``r0:r1`` of the
    first axis. Subclasses set ``shape`` and ``dtype`` and define both methods."""

    shape: tuple = ()
    dtype: np.dtype = np.dtype(np.uint8)
    depth = 0  # lazy arrays below this one (each level computes its source in a scratch slot of its own)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d lazy array")
        return self.shape[0]

    def rows(self, r0: int, r1: int) -> "LazyArray":
        raise NotImplementedError

    def fill(self, out: np.ndarray) -> None:
        raise NotImplementedError

    def materialize(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """The values as a new (or the given, C-contiguous) array, blocks computed on the worker threads."""
        out = np.empty(self.shape, self.dtype) if out is None else out
        if self.ndim == 0 or self.size == 0:
            self.fill(out)
            return out
        current().run([_filler(self, out, r0, r1) for r0, r1 in row_blocks(self, MATERIALIZE_BLOCK)])
        return out

    def transpose(self, *axes):
        """A subclass that can transpose lazily overrides this; here the values are computed first."""
        return self.materialize().transpose(*axes)

    def __getitem__(self, index):
        return self.materialize()[index]

    def __array__(self, dtype=None, copy=None):
        arr = self.materialize()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype})"


def _filler(lazy: LazyArray, out: np.ndarray, r0: int, r1: int):
    return lambda: lazy.rows(r0, r1).fill(out[r0:r1])


def rows_of(array, r0: int, r1: int):
    """Rows ``r0:r1`` of an array or a lazy array (a 0-d one is itself)."""
    if array.ndim == 0:
        return array
    return array.rows(r0, r1) if isinstance(array, LazyArray) else array[r0:r1]


def computed(array, slot=("source", 0)) -> np.ndarray:
    """A lazy array's values in the calling thread's scratch buffer ``slot`` (valid until the next use of
    that slot on this thread); an array as it is."""
    if not isinstance(array, LazyArray):
        return array
    tmp = scratch(array.nbytes, slot).view(array.dtype).reshape(array.shape)
    array.fill(tmp)
    return tmp


class CastArray(LazyArray):
    """``src`` (storage of Paddle dtype ``src_dtype``, any strides, or a lazy array) cast to ``dst_dtype``
    with Paddle's bits (``casts.cast_into``), a block at a time."""

    def __init__(self, src, src_dtype: str, dst_dtype: str, storage: np.dtype):
        self.src, self.src_dtype, self.dst_dtype = src, src_dtype, dst_dtype
        self.shape, self.dtype = tuple(src.shape), np.dtype(storage)
        self.depth = src.depth + 1 if isinstance(src, LazyArray) else 0

    def rows(self, r0: int, r1: int) -> "CastArray":
        return CastArray(rows_of(self.src, r0, r1), self.src_dtype, self.dst_dtype, self.dtype)

    def fill(self, out: np.ndarray) -> None:
        cast_into(out, computed(self.src, ("source", self.depth)), self.src_dtype, self.dst_dtype)

    def transpose(self, *axes) -> "CastArray":
        return CastArray(self.src.transpose(*axes), self.src_dtype, self.dst_dtype, self.dtype)

    @property
    def T(self) -> "CastArray":
        return self.transpose()


def materialize_all(arrays: Sequence) -> list:
    """Arrays as they are, lazy arrays computed (for consumers that need plain arrays)."""
    return [a.materialize() if isinstance(a, LazyArray) else a for a in arrays]


__all__ = ["CastArray", "LazyArray", "computed", "materialize_all", "rows_of"]
