"""Strided tensors into file order: the writer's copies of transposed views, block by block.

A Hugging Face Linear weight is the transpose of Paddle's, so most of a Llama's bytes reach the
writer as a transposed view ([out, in] over [in, out] memory). numpy copies such a view element
by element in the destination's order, reading one element per cache line; when the source's
row pitch is a multiple of 4 KB (hidden size 1024 in float32, 2048 in bfloat16, and most larger
models) every read of a column lands in the same few cache sets and the copy runs at about
0.6-1 GB/s on these machines (narrow column strips, the previous method: 1-2.2 GB/s).

``copy_into`` goes through a small per-thread stage instead: a few hundred source rows at a time are
copied as they lie in memory (contiguous runs) into the stage, whose pitch is padded off 4 KB, and
the stage is then transposed into the destination from the core's L2 cache: 2.4-3.4 GB/s per thread
here for float32 and bfloat16 alike, at 4 KB pitches and others (``bench/export_single.py``,
``facts``, measures it on the benchmark model's shapes). Bits are copied, never computed: NaN
payloads and denormals stay as they are.
"""
from __future__ import annotations

import threading
from typing import Iterator, Tuple

import numpy as np

from .poison import fresh

STAGE_BYTES = 256 * 2**10  # source rows staged at a time: the stage and its transpose stay in L2
_SMALL = 4096  # elements: below this numpy's own copy is as good
_local = threading.local()


def _stage(rows: int, width: int, dtype) -> np.ndarray:
    """A per-thread [rows, width] stage whose pitch is not a multiple of 4 KB (no cache-set aliasing)."""
    item = np.dtype(dtype).itemsize
    pitch = width + 64 // item
    if (pitch * item) % 4096 == 0:
        pitch += 64 // item
    need = rows * pitch * item
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < need:
        buf = _local.buf = np.empty(max(need, STAGE_BYTES + 2**16), np.uint8)
    return fresh(buf[:need].view(dtype).reshape(rows, pitch)[:, :width])


def transposed_view(src: np.ndarray) -> bool:
    """Whether ``src`` is a 2-D view whose columns are contiguous runs (a transpose) worth staging."""
    return (src.ndim == 2 and src.size >= _SMALL and src.strides[0] == src.itemsize
            and src.strides[1] > src.itemsize and src.shape[1] >= 16)


def copy_into(dst: np.ndarray, src: np.ndarray, add: bool = False) -> None:
    """``dst[...] = src`` for a C-contiguous ``dst`` of ``src``'s shape and dtype, fast for a 2-D
    transposed view (columns contiguous in memory); with ``add``, ``dst += src`` (one rounding per element,
    as numpy's ``+=``: a LoRA merge adds a weight's transpose to its update this way).

    >>> x = np.arange(40000, dtype=np.float32).reshape(100, 400)
    >>> for src in (x.T, x.T[:, ::2], x[::3]):
    ...     dst = np.empty(src.shape, src.dtype); copy_into(dst, src)
    ...     assert np.array_equal(dst, src)
    ...     copy_into(dst, src, add=True); assert np.array_equal(dst, src + src)
    """
    if not transposed_view(src):
        if add:
            np.add(dst, src, out=dst)
        else:
            np.copyto(dst, src)
        return
    rows, cols = src.shape
    memory = src.T  # [cols, rows]: each row a contiguous run of the source
    k = max(16, STAGE_BYTES // (rows * src.itemsize))
    stage = _stage(min(k, cols), rows, src.dtype)
    for i in range(0, cols, k):
        n = min(k, cols - i)
        part = stage[:n]
        np.copyto(part, memory[i:i + n])  # sequential reads of n source rows
        if add:
            np.add(dst[:, i:i + n], part.T, out=dst[:, i:i + n])
        else:
            np.copyto(dst[:, i:i + n], part.T)  # the transpose, from the stage in cache


def row_blocks(array: np.ndarray, max_bytes: int) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` row ranges of ``array`` in order, each at most ``max_bytes`` (at least one
    row); a 0-d array or one without rows is one range.

    >>> list(row_blocks(np.zeros((5, 4), np.float32), 40))
    [(0, 2), (2, 4), (4, 5)]
    """
    if array.ndim == 0 or len(array) == 0:
        yield 0, (len(array) if array.ndim else 1)
        return
    row_bytes = max(1, array.nbytes // len(array))
    rows = max(1, int(max_bytes) // row_bytes)
    for r in range(0, len(array), rows):
        yield r, min(len(array), r + rows)
