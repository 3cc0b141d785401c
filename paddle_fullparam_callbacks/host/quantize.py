"""A whole weight quantized to FP8 where the writer consumes it: its scales now, its bytes block by block.

The writer holds every tensor it writes whole (placement puts it there), so each block of the layout lies
in one tensor on one rank and the rule of ``fp8.py`` applies as it stands. :class:`Fp8Weight` takes the
destination as an assembler delivers it (an array of any strides, or a lazy array: a cast to
``export.dtype``, a LoRA merge), computes every block's scale at once (one read of the weight, spread over
the ``export.threads`` workers) and gives the e4m3 bytes as a :class:`LazyArray` that the writer's workers
compute a row block at a time, like a cast: no tensor-sized result is ever allocated.

Two things keep it near the cost of the copy it replaces:

- a Linear weight reaches the writer as the transpose of Paddle's ``[in, out]`` memory: it is read in
  memory order (contiguous runs), and only the e4m3 bytes, one per element, are transposed into file order;
- a cast to bfloat16 or float16 is read from its float32 source and rounded chunk by chunk in the same pass
  (never materialized and transposed first), and its scales are taken from the float32 values: a rounding
  to nearest is monotonic and odd, so the block maxima of the cast values are the casts of the block maxima.

Any other lazy source is computed twice (once for the scales, once for the bytes), a block row at a time.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .casts import _BF16, cast_into, f32_to_bf16, scratch
from .copy import copy_into
from ..plan.quantization import scale_shape
from .fp8 import column_blocks_max, quantize_rows, rows_max_abs, scales_of
from .lazy import CastArray, LazyArray, computed, rows_of
from .pool import current

WIDENED = ("float32", "bfloat16", "float16", "float64")  # what a weight may be quantized from
# elements read, scaled and encoded at a time in memory order. Measured paired (whole FP8 exports of one layer at
# Qwen2.5-7B's, Llama-3-8B's and an ERNIE-4.5-21B-A3B MoE layer's dimensions, 4 interleaved repetitions, 2026-12-06):
# 64K, 128K and 256K are within 10% of each other, each best at one layer; 128K by 4-7% on their geometric mean.
# Large enough that two writer threads do not pass the GIL back and forth between short numpy calls (at 64K a
# chunk's ten calls are ~10 us each), small enough that a chunk's float32 scratch (0.5 MB) stays in a core's L2
_CHUNK = 128 * 2**10


def widened(rows, dtype: str, slot: str) -> np.ndarray:
    """``rows`` (storage of Paddle dtype ``dtype``, any strides) as float32 values: the array itself for
    float32, else a per-thread scratch copy (bfloat16 shifted exactly, float16 exactly, float64 rounded to
    nearest as torch's ``.to(float32)``)."""
    if dtype == "float32":
        return rows
    out = scratch(rows.size * 4, slot).view(np.float32).reshape(rows.shape)
    if dtype == "bfloat16" and _BF16 is not None:  # ml_dtypes' widening: the same 16-bit shift, 2.5x faster here
        np.copyto(out, rows.view(_BF16), casting="unsafe")
    elif dtype == "bfloat16":
        np.left_shift(rows, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, rows, casting="same_kind" if dtype == "float16" else "unsafe")
    return out


def _rounded(values: np.ndarray, dtype: str, slot: str, nans: bool = True) -> np.ndarray:
    """float32 ``values`` rounded to ``dtype`` with Paddle's bits, as float32 (a per-thread scratch copy).
    ``nans``: whether ``values`` may hold a NaN (if not, none is looked for)."""
    from .. import _dtypes

    if dtype == "bfloat16":
        bits = scratch(values.size * 2, slot + " bits").view(np.uint16).reshape(values.shape)
        f32_to_bf16(bits, values, no_nans=not nans)
        return widened(bits, "bfloat16", slot)
    cast = scratch(values.size * _dtypes.lookup(dtype).itemsize, slot + " bits").view(
        _dtypes.lookup(dtype).np_storage).reshape(values.shape)
    cast_into(cast, values, "float32", dtype)
    return widened(cast, dtype, slot)


def _transposed(a) -> bool:
    """Whether ``a`` is a 2-D array laid out column by column (a transposed view): read it as ``a.T``."""
    return isinstance(a, np.ndarray) and a.ndim == 2 and a.strides[0] < a.strides[1] and a.shape[0] > 1


class Fp8Weight:
    """``src`` (2-D ``[out, in]``, storage of Paddle dtype ``dtype``) quantized in ``block`` blocks:
    ``scale_inv`` (float32, computed on construction) and ``weight`` (e4m3 bytes, lazy)."""

    def __init__(self, src, dtype: str, block: Sequence[int]):
        if dtype not in WIDENED or len(src.shape) != 2:
            raise ValueError(f"FP8 quantizes 2-D floating weights; got {dtype}{list(src.shape)}")
        self.src, self.dtype, self.block = src, dtype, (int(block[0]), int(block[1]))
        # read a cast to bfloat16/float16 from its float32 source, rounding on the way (``rounding``)
        self.rounding = None
        self.base, self.base_dtype = src, dtype
        if (isinstance(src, CastArray) and src.src_dtype == "float32" and src.dst_dtype == dtype
                and dtype in ("bfloat16", "float16") and not isinstance(src.src, LazyArray)):
            self.base, self.base_dtype, self.rounding = src.src, "float32", dtype
        self.memory_order = _transposed(self.base)  # read base.T's rows: contiguous runs
        max_abs = self._max_abs()
        self.nans = np.isnan(max_abs)  # the blocks that hold a NaN (the others need no search for one)
        self.scale, self.scale_inv = scales_of(max_abs)
        self.weight = Fp8Array(self, 0, src.shape[0])

    def _max_abs(self) -> np.ndarray:
        """Block maxima of |values| (the cast's values when ``rounding``), NaN where a block holds one."""
        if self.memory_order:  # blocks of base.T, whose rows are base's columns: the grid comes out transposed
            rows, (b0, b1) = self.base.T, self.block[::-1]
        else:
            rows, (b0, b1) = self.base, self.block
        out = np.empty(scale_shape(rows.shape, (b0, b1)), np.float32)
        dtype = self.base_dtype

        def task(g):
            def run():
                part = computed(rows_of(rows, g * b0, min(len(rows), (g + 1) * b0)), ("fp8 source", 0))
                out[g] = column_blocks_max(rows_max_abs(widened(part, dtype, "fp8 widened")), b1)
            return run

        current().run([task(g) for g in range(out.shape[0])])
        if self.rounding is not None:
            out = _rounded(out, self.rounding, "fp8 grid").copy()
        return out.T.copy() if self.memory_order else out


class Fp8Array(LazyArray):
    """The e4m3 bytes of rows ``r0:r1`` of an :class:`Fp8Weight`, computed where they are consumed."""

    def __init__(self, q: Fp8Weight, r0: int, r1: int):
        self.q, self.r0, self.r1 = q, r0, r1
        self.shape, self.dtype = (r1 - r0, q.src.shape[1]), np.dtype(np.uint8)

    def rows(self, r0: int, r1: int) -> "Fp8Array":
        return Fp8Array(self.q, self.r0 + r0, self.r0 + r1)

    def _values(self, part: np.ndarray, nans) -> np.ndarray:
        """float32 values of a piece of the base (rounded to the cast's dtype first, for a cast); ``nans``: the
        NaN flags of the blocks it lies in."""
        q = self.q
        if q.rounding is not None:
            return _rounded(part, q.rounding, "fp8 rounded", nans=bool(np.any(nans)))
        return widened(part, q.base_dtype, "fp8 widened")

    def fill(self, out: np.ndarray) -> None:
        if self.q.memory_order:
            self._fill_memory_order(out)
            return
        q = self.q
        b0, b1 = q.block
        cols = q.src.shape[1]
        r = self.r0
        while r < self.r1:  # one block row at a time: one row of scales
            g = r // b0
            end = min(self.r1, (g + 1) * b0)
            scale_row = np.repeat(q.scale[g], b1)[:cols]
            if q.rounding is None:
                values = widened(computed(rows_of(q.src, r, end), ("fp8 source", 0)), q.dtype, "fp8 widened")
                quantize_rows(out[r - self.r0:end - self.r0], values, scale_row)
            else:  # a cast, rounded chunk by chunk from its source
                step = max(1, _CHUNK // max(1, cols))
                for s in range(r, end, step):
                    e = min(end, s + step)
                    quantize_rows(out[s - self.r0:e - self.r0], self._values(q.base[s:e], q.nans[g]), scale_row)
            r = end

    def _fill_memory_order(self, out: np.ndarray) -> None:
        """Rows r0:r1 of ``base.T``'s transpose: read ``base.T[:, r0:r1]`` row by row (each a contiguous run),
        scale and encode into a per-thread stage in that order, then transpose the bytes into ``out`` (the staged
        transposed copy of ``copy.py``). A chunk of memory rows lies in one block column."""
        q = self.q
        b0, b1 = q.block
        memory = q.base.T  # [in, out]
        n = self.r1 - self.r0
        # the scales of a memory row's elements (output rows r0..r1) in block column j: scales[j]
        scales = np.ascontiguousarray(q.scale[np.arange(self.r0, self.r1) // b0].T)
        codes = scratch(memory.shape[0] * n, "fp8 codes").reshape(memory.shape[0], n)
        step = max(1, min(b1, _CHUNK // max(1, n)))
        c0 = 0
        while c0 < memory.shape[0]:  # a chunk starts where the last ended: clipped at a block's end, the next
            j = c0 // b1  # starts there (a step that does not divide b1 once left rows unencoded: issue 46)
            c1 = min(memory.shape[0], c0 + step, (j + 1) * b1)
            values = self._values(memory[c0:c1, self.r0:self.r1], q.nans[self.r0 // b0:(self.r1 - 1) // b0 + 1, j])
            quantize_rows(codes[c0:c1], values, scales[j])
            c0 = c1
        copy_into(out, codes.T)


__all__ = ["Fp8Array", "Fp8Weight", "WIDENED", "widened"]
