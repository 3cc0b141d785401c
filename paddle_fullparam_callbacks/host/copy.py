"""Strided tensors into file order: the writer's copies of transposed views, block by block.

A Hugging Face Linear weight is the transpose of Paddle's, so most of a Llama's bytes reach the
writer as a transposed view ([out, in] over [in, out] memory). numpy copies such a view element
by element in the destination's order, reading one element per cache line; when the source's
row pitch is a multiple of 4 KB (hidden size 1024 in float32, 2048 in bfloat16) every read of a
column lands in the same few cache sets and the copy runs at about 0.25-1 GB/s on these machines.
Copying it in narrow column strips (16 columns, 16 sequential source streams) runs at 2-2.9 GB/s
there for float32 and 1.1-2.5 GB/s for bfloat16 (hidden 8192 to 1024); other pitches copy fastest
in square tiles (about 4 GB/s against 2.7 for numpy's own order). ``bench/export_single.py``
(``facts``) measures both on the benchmark model's shapes.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import numpy as np

STRIP_COLUMNS = 16  # a 64-byte line of float32 destination rows (32 bytes of bfloat16)
TILE_BYTES = 256 * 2**10  # square tiles whose source and copy stay in a core's L2 cache
_ALIASING_PITCH = 4096  # source pitches that are multiples of this thrash the cache sets
_SMALL = 4096  # elements: below this numpy's own copy is as good


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for a C-contiguous ``dst`` of ``src``'s shape and dtype, fast for a 2-D
    transposed view (columns contiguous in memory).

    >>> x = np.arange(40000, dtype=np.float32).reshape(100, 400)
    >>> for src in (x.T, x.T[:, ::2], x[::3]):
    ...     dst = np.empty(src.shape, src.dtype); copy_into(dst, src)
    ...     assert np.array_equal(dst, src)
    """
    if src.ndim != 2 or src.size < _SMALL or src.strides[0] != src.itemsize or src.strides[1] <= src.itemsize:
        np.copyto(dst, src)
        return
    rows, cols = src.shape
    if src.strides[1] % _ALIASING_PITCH == 0:
        k = STRIP_COLUMNS if src.itemsize <= 4 else 8  # 16 columns also for 2-byte types: 2.5x faster than 32
        for j in range(0, cols, k):
            np.copyto(dst[:, j:j + k], src[:, j:j + k])
        return
    t = max(16, int((TILE_BYTES // src.itemsize) ** 0.5))
    for i in range(0, rows, t):
        for j in range(0, cols, t):
            np.copyto(dst[i:i + t, j:j + t], src[i:i + t, j:j + t])


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
