"""Block-scaled FP8 (float8_e4m3fn) quantization of a weight, bit for bit transformers' ``Fp8Quantize``.

The rule (transformers 5.x, ``integrations/finegrained_fp8.py``), for a weight widened to float32 and
cut into blocks of ``block = (b0, b1)`` (rows, columns; the last block of a dimension that is not a
multiple of the block is partial):

1. ``max_abs`` of each block (NaN if the block holds a NaN);
2. ``scale = reciprocal(max_abs)`` rounded to float32, times 448 rounded to float32 (how torch computes
   ``448 / max_abs``: a true division differs in the last bit for about a quarter of the blocks); a
   block whose ``max_abs`` is not > 0 (all zeros, or NaN) gets ``scale = 1``;
3. ``weight_scale_inv = 1 / scale`` (float32), what the snapshot stores;
4. each element ``clamp(w * scale, -448, 448)`` (float32 product) cast to e4m3 rounding to nearest,
   ties to even; a NaN stays a NaN (``0x7F``, with its sign bit).

Edge cases follow from it as transformers has them: a block with an infinity has ``scale = 0``, so its
finite values become 0 and the infinity a NaN (``inf * 0``); a block whose ``max_abs`` is below
``448 / FLT_MAX`` (about 1.3e-36, subnormal weights) has ``scale = inf``, so its zeros become NaN.

The cast is this module's own, vectorised with numpy: the float32 bits are shortened to their top 16 with
the bits below folded into the lowest one ("round to odd", which keeps a later rounding to fewer bits
exact), and a 65536-entry table gives the e4m3 byte of every such value, clamp and NaN included. All
of it releases the GIL: the writer's workers quantize blocks of one tensor side by side.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from ..plan.quantization import scale_shape
from .casts import scratch

E4M3_MAX = 448.0
_SUB = 128 * 2**10  # elements per step of the cast: as quantize._CHUNK, measured with it


def e4m3_values() -> np.ndarray:
    """float64 value of each e4m3fn byte 0..255 (NaN for 0x7F and 0xFF; no infinities).

    >>> [float(v) for v in e4m3_values()[[0x01, 0x08, 0x38, 0x7E, 0xFE]]]
    [0.001953125, 0.015625, 1.0, 448.0, -448.0]
    """
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


def _table() -> np.ndarray:
    """The e4m3 byte of each float32 ``k << 16`` (k = 0..65535): clamped to +-448, rounded to nearest even."""
    with np.errstate(invalid="ignore"):
        x = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
    nan = np.isnan(x)
    a = np.minimum(np.where(nan, 0.0, np.abs(x)), E4M3_MAX)
    grid = e4m3_values()[:0x7F]  # the 127 finite magnitudes, increasing with their code
    hi = np.minimum(np.searchsorted(grid, a), 0x7E)  # grid[hi - 1] < a <= grid[hi]
    lo = np.maximum(hi - 1, 0)
    below, above = a - grid[lo], grid[hi] - a
    code = np.where(above < below, hi, np.where(below < above, lo, np.where(hi % 2 == 0, hi, lo)))
    code = np.where(a == grid[hi], hi, code).astype(np.uint8)
    code[nan] = 0x7F
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


_TABLE = _table()


def encode_e4m3(out: np.ndarray, y: np.ndarray) -> None:
    """``out`` (uint8) = ``y`` (float32, same shape, C-contiguous) clamped to +-448 and cast to e4m3fn
    bytes, rounding to nearest even; NaN to 0x7F with the sign bit of the NaN.

    >>> y = np.array([1.0, 1.0625, 1.0625001, -500.0, 2.0 ** -10, np.nan], np.float32)
    >>> out = np.empty(6, np.uint8); encode_e4m3(out, y); [hex(v) for v in out]
    ['0x38', '0x38', '0x39', '0xfe', '0x0', '0x7f']
    """
    u, o = y.reshape(-1).view(np.uint32), out.reshape(-1)
    for s in range(0, u.size, _SUB):
        part = u[s:s + _SUB]
        key = scratch(part.nbytes, "fp8 key").view(np.uint32)
        index = scratch(part.size * np.dtype(np.intp).itemsize, "fp8 index").view(np.intp)
        np.bitwise_and(part, 0xFFFF, out=key)
        np.add(key, 0xFFFF, out=key)  # bit 16 is set where any of the 16 low bits is
        np.bitwise_or(key, part, out=key)  # ... and folded into the lowest kept bit: round to odd
        # the top 16 bits as the table's index, of numpy's index type (take would convert any other first)
        np.right_shift(key, 16, out=index, casting="unsafe")
        np.take(_TABLE, index, out=o[s:s + _SUB], mode="wrap")


def decode_e4m3(q: np.ndarray) -> np.ndarray:
    """The float32 values of e4m3fn bytes."""
    return e4m3_values().astype(np.float32)[q]


def scales_of(max_abs: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(``scale``, ``weight_scale_inv``) of blocks with these float32 ``max_abs``, by the rule of the module."""
    m = np.asarray(max_abs, np.float32)
    positive = m > 0
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scale = np.reciprocal(np.where(positive, m, np.float32(1))) * np.float32(E4M3_MAX)
        scale = np.where(positive, scale, np.float32(1)).astype(np.float32)
        return scale, np.reciprocal(scale).astype(np.float32)


def column_blocks_max(column_max: np.ndarray, b1: int) -> np.ndarray:
    """Per block of ``b1`` columns (the last one partial), the max of ``column_max`` (NaN-propagating)."""
    n = column_max.shape[-1]
    full = n - n % b1
    parts = [column_max[..., :full].reshape(*column_max.shape[:-1], full // b1, b1).max(axis=-1)]
    if full < n:
        parts.append(column_max[..., full:].max(axis=-1, keepdims=True))
    return np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def rows_max_abs(w: np.ndarray) -> np.ndarray:
    """max |w| over the rows of ``w`` (2-D float32, any strides), per column; NaN where a column has one."""
    return np.maximum(w.max(axis=0), np.negative(w.min(axis=0)))


def quantize_rows(out: np.ndarray, w: np.ndarray, scale_row: np.ndarray) -> None:
    """``out`` (uint8, C-contiguous) = e4m3 of ``w * scale_row`` (``w``: float32 rows, ``scale_row``: the scale
    of each column of these rows, which lie in one block row)."""
    rows = max(1, _SUB // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):
        part = w[r:r + rows]
        y = scratch(part.size * 4, "fp8 product").view(np.float32).reshape(part.shape)
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(part, scale_row, out=y)
        encode_e4m3(out[r:r + rows], y)


def quantize(w: np.ndarray, block: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(e4m3 bytes ``[out, in]`` uint8, ``weight_scale_inv`` float32 ``scale_shape(w.shape, block)``) of a 2-D float32
    ``w``, in one thread (the writer quantizes block rows on its workers: ``host/quantize.py``).

    >>> q, inv = quantize(np.array([[1.0, -2.0], [0.5, 0.0]], np.float32), (2, 2))
    >>> [hex(v) for v in q.reshape(-1)], inv.tolist()
    (['0x76', '0xfe', '0x6e', '0x0'], [[0.004464285913854837]])
    """
    b0, b1 = (int(b) for b in block)
    w = np.asarray(w, np.float32)
    out = np.empty(w.shape, np.uint8)
    nbr, _ = scale_shape(w.shape, block)
    max_abs = np.stack([column_blocks_max(rows_max_abs(w[g * b0:(g + 1) * b0]), b1) for g in range(nbr)]) \
        if w.size else np.zeros(scale_shape(w.shape, block), np.float32)
    scale, inv = scales_of(max_abs)
    for g in range(nbr):
        quantize_rows(out[g * b0:(g + 1) * b0], w[g * b0:(g + 1) * b0], np.repeat(scale[g], b1)[:w.shape[1]])
    return out, inv


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: Sequence[int]) -> np.ndarray:
    """float32 ``e4m3(q) * weight_scale_inv`` block by block (partial edge blocks included)."""
    b0, b1 = (int(b) for b in block)
    inv = np.repeat(np.repeat(scale_inv, b0, axis=0), b1, axis=1)[:q.shape[0], :q.shape[1]]
    return decode_e4m3(q) * inv


__all__ = ["E4M3_MAX", "column_blocks_max", "decode_e4m3", "dequantize", "e4m3_values", "encode_e4m3", "quantize",
           "quantize_rows", "rows_max_abs", "scales_of"]
