"""A whole weight quantized to FP8 where the writer consumes it: its scales now, its bytes block by block.

The writer holds every tensor it writes whole (placement puts it there), so each block of the layout lies
in one tensor on one rank and the rule of ``fp8.py`` applies as it stands. :class:`Fp8Weight` takes the
destination as an assembler delivers it (an array of any strides, or a lazy array: a cast to
``export.dtype``, a LoRA merge), computes every block's scale at once (one read of the weight, its block
rows spread over the ``export.threads`` workers) and gives the e4m3 bytes as a :class:`LazyArray` that the
writer's workers compute a row block at a time, like a cast: no tensor-sized result is ever allocated.

The scales of a cast to bfloat16 or float16 are taken from the cast's float32 source (a rounding to
nearest is monotonic and odd, so the block maxima of the cast values are the casts of the block maxima):
the cast runs once, when the bytes are made. Any other lazy source is computed twice (once for the
scales, once for the bytes), a block row at a time.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .casts import cast_into, scratch
from .fp8 import column_blocks_max, grid, quantize_rows, rows_max_abs, scales_of
from .lazy import CastArray, LazyArray, computed, rows_of
from .pool import current

WIDENED = ("float32", "bfloat16", "float16", "float64")  # what a weight may be quantized from


def widened(rows, dtype: str, slot: str) -> np.ndarray:
    """``rows`` (storage of Paddle dtype ``dtype``, any strides) as float32 values: the array itself for
    float32, else a per-thread scratch copy (bfloat16 shifted exactly, float16 exactly, float64 rounded to
    nearest as torch's ``.to(float32)``)."""
    if dtype == "float32":
        return rows
    out = scratch(rows.size * 4, slot).view(np.float32).reshape(rows.shape)
    if dtype == "bfloat16":
        np.left_shift(rows, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, rows, casting="same_kind" if dtype == "float16" else "unsafe")
    return out


def _cast_grid(values: np.ndarray, dst: str) -> np.ndarray:
    """float32 ``values`` cast to ``dst`` with Paddle's bits, and widened back to float32."""
    from .. import _dtypes

    out = np.empty(values.shape, _dtypes.lookup(dst).np_storage)
    cast_into(out, values, "float32", dst)
    return widened(out, dst, "fp8 grid").copy()


class Fp8Weight:
    """``src`` (2-D ``[out, in]``, storage of Paddle dtype ``dtype``) quantized in ``block`` blocks:
    ``scale_inv`` (float32, computed on construction) and ``weight`` (e4m3 bytes, lazy)."""

    def __init__(self, src, dtype: str, block: Sequence[int]):
        if dtype not in WIDENED or len(src.shape) != 2:
            raise ValueError(f"FP8 quantizes 2-D floating weights; got {dtype}{list(src.shape)}")
        self.src, self.dtype, self.block = src, dtype, (int(block[0]), int(block[1]))
        self.scale, self.scale_inv = scales_of(self._max_abs())
        self.weight = Fp8Array(self, 0, src.shape[0])

    def _max_abs(self) -> np.ndarray:
        src, dtype = self.src, self.dtype
        cast_from_f32 = (isinstance(src, CastArray) and src.src_dtype == "float32" and src.dst_dtype == dtype
                         and dtype in ("bfloat16", "float16"))
        if cast_from_f32:
            src, dtype = src.src, "float32"
        b0, b1 = self.block
        out = np.empty(grid(src.shape, self.block), np.float32)

        def task(g):
            def run():
                rows = computed(rows_of(src, g * b0, min(len(src), (g + 1) * b0)), ("fp8 source", 0))
                out[g] = column_blocks_max(rows_max_abs(widened(rows, dtype, "fp8 widened")), b1)
            return run

        current().run([task(g) for g in range(out.shape[0])])
        return _cast_grid(out, self.dtype) if cast_from_f32 else out


class Fp8Array(LazyArray):
    """The e4m3 bytes of rows ``r0:r1`` of an :class:`Fp8Weight`, computed where they are consumed."""

    def __init__(self, q: Fp8Weight, r0: int, r1: int):
        self.q, self.r0, self.r1 = q, r0, r1
        self.shape, self.dtype = (r1 - r0, q.src.shape[1]), np.dtype(np.uint8)

    def rows(self, r0: int, r1: int) -> "Fp8Array":
        return Fp8Array(self.q, self.r0 + r0, self.r0 + r1)

    def fill(self, out: np.ndarray) -> None:
        q = self.q
        b0, b1 = q.block
        cols = q.src.shape[1]
        r = self.r0
        while r < self.r1:  # one block row at a time: one row of scales
            g = r // b0
            end = min(self.r1, (g + 1) * b0)
            rows = computed(rows_of(q.src, r, end), ("fp8 source", 0))
            quantize_rows(out[r - self.r0:end - self.r0], widened(rows, q.dtype, "fp8 widened"),
                          np.repeat(q.scale[g], b1)[:cols])
            r = end


__all__ = ["Fp8Array", "Fp8Weight", "WIDENED", "widened"]
