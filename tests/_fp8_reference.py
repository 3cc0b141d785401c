"""The FP8 rule written out a second time, for the tests: slow, plain, and independent of ``host/fp8.py``.

transformers' ``Fp8Quantize`` (5.x): per block of the float32 weight, ``max_abs``; ``scale = 448 / max_abs``
as torch computes it (``reciprocal`` rounded to float32, times 448 rounded to float32), 1 where
``max_abs`` is not > 0; ``weight_scale_inv = 1 / scale``; each element ``clamp(w * scale, -448, 448)``
rounded to the nearest e4m3 value, ties to the even code. Here the rounding is done on the value in
float64 (exact for these numbers): its binade's quantum, ``numpy.rint`` (ties to even), a clamp; the byte
is then looked up among the 256 codes' values. Blocks are cut with explicit loops, partial at the edges.
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0


def e4m3_table() -> dict:
    """float64 value -> byte, for every finite e4m3fn code (+0 and -0 separately)."""
    out = {}
    for code in range(256):
        e, m = (code >> 3) & 0xF, code & 7
        if (code & 0x7F) == 0x7F:
            continue
        v = (m / 8.0) * 2.0 ** -6 if e == 0 else (1.0 + m / 8.0) * 2.0 ** (e - 7)
        v = -v if code & 0x80 else v
        out[(v, np.signbit(v))] = code
    return out


_TABLE = e4m3_table()


def e4m3_byte(x: float) -> int:
    """The e4m3fn byte of one float32 value already clamped to +-448 (NaN: 0x7F with its sign)."""
    x = float(x)
    if np.isnan(x):
        return 0x7F | (0x80 if np.signbit(x) else 0)
    a = min(abs(x), E4M3_MAX)
    exponent = max(int(np.floor(np.log2(a))) if a > 0 else -6, -6)  # below 2^-6: the subnormal quantum 2^-9
    quantum = 2.0 ** (exponent - 3)
    r = float(np.rint(a / quantum)) * quantum  # ties to even: an even multiple of the quantum is the even code
    r = min(r, E4M3_MAX)
    value = -r if np.signbit(x) else r
    return _TABLE[(value, np.signbit(value))]


def quantize(w, block):
    """(bytes uint8 [out, in], weight_scale_inv float32) of a 2-D float32 weight, block by block."""
    w = np.asarray(w, np.float32)
    b0, b1 = block
    rows, cols = w.shape
    nbr, nbc = -(-rows // b0), -(-cols // b1)
    q = np.empty(w.shape, np.uint8)
    inv = np.empty((nbr, nbc), np.float32)
    for i in range(nbr):
        for j in range(nbc):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            m = np.float32(np.max(np.abs(blk)))  # NaN if the block holds one
            with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
                if m > 0:
                    scale = np.float32(np.float32(np.float32(1.0) / m) * np.float32(E4M3_MAX))
                else:
                    scale = np.float32(1.0)
                inv[i, j] = np.float32(np.float32(1.0) / scale)
                y = (blk * scale).astype(np.float32)
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = np.vectorize(e4m3_byte, otypes=[np.uint8])(y)
    return q, inv


def decode(q) -> np.ndarray:
    """float32 values of e4m3fn bytes."""
    values = np.full(256, np.nan)
    for (v, _), code in _TABLE.items():
        values[code] = v
    return values.astype(np.float32)[np.asarray(q)]


def dequantize(q, inv, block) -> np.ndarray:
    b0, b1 = block
    scale = np.repeat(np.repeat(inv, b0, axis=0), b1, axis=1)[:q.shape[0], :q.shape[1]]
    return decode(q) * scale


def widen_bf16(bits) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)
