"""The one rule for every LoRA product in the package: ``A @ B`` rounded once, exactly.

Element ``(i, j)`` of the product of float32 ``A [m, r]`` and ``B [r, n]`` is **the float32 nearest to
the exact real sum** ``sum_k A[i, k] * B[k, j]`` (round to nearest, ties to even; an exact zero is
``+0.0``; a NaN or infinity among the inputs gives what IEEE arithmetic gives). The rule names a
number, not an algorithm, so its bits depend on nothing but the inputs: not on the machine's BLAS, its
CPU kernel, its thread count, nor on how a weight is cut into blocks (a tensor-parallel rank's block, a
writer's row block, ``convert``'s region: each is the same as in the whole product).

Why not a BLAS ``sgemm``: OpenBLAS picks its kernel by CPU and its code path by size and thread count,
and the float32 results differ between them (seen: 2 threads on an AMD EPYC against 1, issue 30;
blocks against the whole product for r >= 32). A fused multiply-add chain in a fixed order would fix
the bits but costs r passes over the weight.

How it is computed, fast: the product in float64 by BLAS (each float32 x float32 product is exact in
float64; only the additions round, by at most ``gamma_r * sum |a||b|`` whatever the order), then each
element rounded to float32. When the interval the exact sum may lie in rounds to one float32, that is
the answer; when every partial sum is exact in float64 (factors with short mantissas, as bfloat16-born
ones), the float64 result is the exact sum and its cast is the answer; the rare elements left (about
one in 10^5 for random data) are summed exactly with ``fractions.Fraction`` and rounded by hand.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Optional

import numpy as np

from ...host import blas

_ROWS_ELEMENTS = 1 << 16  # elements per step: the float64 temporaries of a step stay in a core's L2 cache
_F32_MAX = Fraction(float(np.finfo(np.float32).max))
_F32_OVERFLOW = _F32_MAX + Fraction(2) ** (127 - 24)  # |x| from here on rounds to infinity


def round_to_float32(x: Fraction) -> np.float32:
    """The float32 nearest to the exact rational ``x`` (ties to even; beyond the largest float32 by half
    an ulp or more, infinity).

    >>> float(round_to_float32(Fraction(1) + Fraction(1, 2**24)))  # a tie: to the even neighbour, 1.0
    1.0
    >>> float(round_to_float32(Fraction(1) + Fraction(1, 2**24) + Fraction(1, 2**60)))  # past the tie
    1.0000001192092896
    """
    if abs(x) >= _F32_OVERFLOW:
        return np.float32(np.inf if x > 0 else -np.inf)
    with np.errstate(over="ignore"):
        near = np.float32(float(x))  # float(Fraction) rounds correctly to float64; then once more
    if not np.isfinite(near):
        near = np.float32(np.finfo(np.float32).max * (1 if x > 0 else -1))
    best = None
    for c in (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))):
        if not np.isfinite(c):
            continue
        d = abs(Fraction(float(c)) - x)
        even = (int(np.array(c, np.float32).view(np.uint32)) & 1) == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, c)
    out = best[1]
    return np.float32(0.0) if out == 0 else out  # an exact zero is +0.0


def exact_sum_float32(a_row: np.ndarray, b_col: np.ndarray) -> np.float32:
    """One element by the rule, with exact rationals (the slow path, and the definition)."""
    if not (np.all(np.isfinite(a_row)) and np.all(np.isfinite(b_col))):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.float32(np.dot(a_row.astype(np.float64), b_col.astype(np.float64)))
    return round_to_float32(sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a_row, b_col)), Fraction(0)))


def _lowest_bit_exponents(x: np.ndarray) -> np.ndarray:
    """For each float32 ``x``, the exponent of its lowest set bit (``x`` is a multiple of 2 to that power);
    a large number for zeros and non-finite values (they constrain nothing)."""
    finite = np.isfinite(x)
    mant, exp = np.frexp(np.where(finite, x, 0).astype(np.float64))  # x = mant * 2^exp, 0.5 <= |mant| < 1
    ints = np.abs(mant * 2.0**24).astype(np.int64)  # float32: 24 significant bits, an integer
    low = np.frexp((ints & -ints).astype(np.float64))[1] - 1  # log2 of the lowest set bit of the integer
    out = exp - 24 + low
    out[(ints == 0) | ~finite] = 1 << 20
    return out


def _rows_into(out: np.ndarray, a: np.ndarray, b: np.ndarray, b_low: np.ndarray) -> None:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    v = np.matmul(a64, b64)
    bound = np.matmul(np.abs(a64), np.abs(b64))  # the sum of |products|, within (1 + gamma_r)
    # |v - exact sum| <= gamma_r * sum|products| (any order, fused or not): (r + 2) * 2^-52 covers both roundings
    slack = bound * ((a.shape[1] + 2) * 2.0 ** -52)
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, v, casting="unsafe")
        v -= slack
        slack *= 2
        slack += v  # v + slack
        unsure = v.astype(np.float32) != slack.astype(np.float32)
    rows, cols = np.nonzero(unsure)
    out[out == 0] = 0.0  # -0.0 -> +0.0: an exact zero sum is +0.0
    if not len(rows):
        return
    # the few left: is the float64 sum exact? Every product of row i and column j is a multiple of
    # 2^(qa_i + qb_j); below 2^53 of those, every partial sum is exact in any order, and the cast already made
    # rounds the exact sum correctly (bfloat16-born factors, whose sums often land on a float32 tie, end here)
    which = np.unique(rows)
    lows = _lowest_bit_exponents(a[which]).min(axis=1)[np.searchsorted(which, rows)] + b_low[cols] + 53
    big = bound[rows, cols]
    exact = big * (1 + (a.shape[1] + 2) * 2.0 ** -52) < np.ldexp(1.0, np.minimum(lows, 1000))
    for i, j in zip(rows[~exact & np.isfinite(big)], cols[~exact & np.isfinite(big)]):
        out[i, j] = exact_sum_float32(a[i], b[:, j])  # and the rest, exactly


def exact_product(a: np.ndarray, b: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """``A @ B`` by the rule (module docstring): float32 ``a [m, r]`` and ``b [r, n]`` (any strides), into
    ``out`` (float32 ``[m, n]``, new if None). BLAS runs on the calling thread (``host/blas.py``: the
    export's workers already run side by side); its thread count does not change the bits.

    >>> a = np.array([[1.0, 2.0**-24, 2.0**-60]], np.float32); b = np.ones((3, 1), np.float32)
    >>> exact_product(a, b).tolist()  # 1 + 2^-24 + 2^-60 is past the tie between 1 and 1 + 2^-23
    [[1.0000001192092896]]
    """
    m, r = a.shape
    if b.shape[0] != r:
        raise ValueError(f"product shapes do not fit: A {list(a.shape)}, B {list(b.shape)}")
    n = b.shape[1]
    if out is None:
        out = np.empty((m, n), np.float32)
    if m == 0 or n == 0:
        return out
    if r == 0:
        out[...] = 0.0
        return out
    step = max(1, _ROWS_ELEMENTS // max(n, 1))
    b_low = _lowest_bit_exponents(b).min(axis=0)
    with blas.one_thread():
        for i in range(0, m, step):
            _rows_into(out[i:i + step], a[i:i + step], b, b_low)
    return out


__all__ = ["exact_product", "exact_sum_float32", "round_to_float32"]
