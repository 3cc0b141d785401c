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

How it is computed, fast (issue 42: one float64 product, no second one for the bound): the product in
float64 by BLAS (each float32 x float32 product is exact in float64; only the additions round, by at most
``gamma_r * sum |a||b|`` whatever the order), then each element rounded to float32. A step of rows is
checked at once against one bound for the whole step (the largest ``sum |a||b|`` it can hold, from the
rows' and columns' sums and maxima, no product): where ``v - e`` and ``v + e`` round to one float32, so
does the exact sum, and that float32 is the answer (three passes over the step). The few elements left
(a float32 rounding boundary near ``v``, results near zero: about 2 in 10^5 for random data) get their
own bound, ``sum |a||b|`` of their row and column; when it still leaves two answers and every partial sum
is exact in float64 (factors with short mantissas, as bfloat16-born ones), the float64 result is the
exact sum and its cast is the answer; the rare rest (about one in 10^5) are summed exactly with
``fractions.Fraction`` and rounded by hand.
"""
from __future__ import annotations

import math
import threading
from fractions import Fraction
from typing import Optional

import numpy as np

from ...host import blas
from ...host.poison import fresh

_ROWS_ELEMENTS = 1 << 15  # elements per step: the step's float64 product and float32 temporaries stay in L2
# rows per BLAS call: OpenBLAS 0.3's float64 product of k = 16 runs 2-3x slower from about 24 rows on (measured
# here: 3.4-3.8 ns per element up to 20 rows, 6-12 ns from 24 on, at 1024, 2816 and 4096 columns)
_GEMM_ROWS = 16
_F32_MAX = Fraction(float(np.finfo(np.float32).max))
_F32_OVERFLOW = _F32_MAX + Fraction(2) ** (127 - 24)  # |x| from here on rounds to infinity


class _Buffers:
    """A thread's reused temporaries for steps of ``elements``: the float64 product, two float32 roundings, a mask."""

    def __init__(self, elements: int):
        self.v = np.empty(elements, np.float64)
        self.high, self.low = np.empty(elements, np.float32), np.empty(elements, np.float32)
        self.same = np.empty(elements, np.bool_)


_local = threading.local()


def _scratch(elements: int) -> _Buffers:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.v.size < elements:
        buf = _local.buf = _Buffers(max(elements, _ROWS_ELEMENTS))
    for a in (buf.v, buf.high, buf.low, buf.same):
        fresh(a)
    return buf


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
    """One element by the rule, exactly (the slow path, and the definition): each product of two float32 is exact
    in float64, an integer times a power of two; their sum is one integer at the lowest power, rounded by hand."""
    if not (np.all(np.isfinite(a_row)) and np.all(np.isfinite(b_col))):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.float32(np.dot(a_row.astype(np.float64), b_col.astype(np.float64)))
    terms = []
    for x, y in zip(a_row.tolist(), b_col.tolist()):
        m, e = math.frexp(x * y)  # x * y = m * 2^e exactly (24 + 24 bits fit float64's 53)
        if m:
            terms.append((int(m * 2.0**53), e - 53))
    if not terms:
        return np.float32(0.0)
    low = min(e for _, e in terms)
    return _round_scaled(sum(m << (e - low) for m, e in terms), low)


def _round_scaled(n: int, e: int) -> np.float32:
    """The float32 nearest to ``n * 2^e`` (ties to even; +0.0 for zero, infinity beyond the largest float32).

    >>> float(_round_scaled(2**24 + 1, -24)), float(_round_scaled(2**24 + 3, -24))  # ties: to even
    (1.0, 1.000000238418579)
    """
    if n == 0:
        return np.float32(0.0)
    sign, n = (-1.0 if n < 0 else 1.0), abs(n)
    q = max(n.bit_length() + e - 24, -149)  # the exponent of the result's last bit (subnormals: 2^-149)
    shift = q - e
    if shift > 0:
        keep, rem = n >> shift, n & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and keep & 1):
            keep += 1
    else:
        keep = n << -shift
    if keep == 0:
        return np.float32(0.0)  # an exact zero is +0.0, and so is a sum that rounds to zero
    if keep * 2.0**q >= 2.0**128:
        return np.float32(sign * np.inf)
    return np.float32(sign * math.ldexp(keep, q))


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


def _settle(out: np.ndarray, vals: np.ndarray, a: np.ndarray, b: np.ndarray, a64: np.ndarray, b64: np.ndarray,
            rows: np.ndarray, cols: np.ndarray) -> None:
    """Elements ``(rows, cols)`` of ``out`` (their float64 products ``vals``) that their step's bound left open,
    each by the rule: its own bound ``sum |a||b|``, then the exactness of the float64 sum, then exact rationals."""
    big = np.einsum("ek,ke->e", np.abs(a64[rows]), np.abs(b64[:, cols]))  # sum |products|, within (1 + gamma_r)
    # |v - exact sum| <= gamma_r * sum|products| (any order, fused or not): (r + 2) * 2^-52 covers both roundings
    slack = big * ((a.shape[1] + 2) * 2.0 ** -52)
    got = vals.astype(np.float32)
    unsure = (vals - slack).astype(np.float32) != (vals + slack).astype(np.float32)
    got[got == 0] = 0.0  # -0.0 -> +0.0: an exact zero sum is +0.0
    out[rows, cols] = got
    if not unsure.any():
        return
    rows, cols, big = rows[unsure], cols[unsure], big[unsure]
    # is the float64 sum exact? Every product of row i and column j is a multiple of 2^(qa_i + qb_j); below 2^53
    # of those, every partial sum is exact in any order, and the cast already made rounds the exact sum correctly
    # (bfloat16-born factors, whose sums often land on a float32 tie, end here)
    lows = _lowest_bit_exponents(a[rows]).min(axis=1) + _lowest_bit_exponents(b[:, cols]).min(axis=0) + 53
    exact = big * (1 + (a.shape[1] + 2) * 2.0 ** -52) < np.ldexp(1.0, np.minimum(lows, 1000))
    left = ~exact & np.isfinite(big)  # a NaN or an infinity among the factors: what IEEE arithmetic gives
    for i, j in zip(rows[left], cols[left]):
        out[i, j] = exact_sum_float32(a[i], b[:, j])  # and the rest, exactly


def _step_into(out: np.ndarray, v: np.ndarray, high: np.ndarray, same: np.ndarray, bound: float, r: int) -> np.ndarray:
    """``out`` := float32 of ``v - e`` and ``high`` := of ``v + e``, ``e`` covering the float64 product's error for
    every element of the step (and 2^-148, so that no result near zero passes: its sign is the rule's);
    returns where the two differ (flat indices): the elements the step's bound leaves open."""
    # (r + 2) * 2^-52 * bound is the float64 product's error (as in _settle); twice that, and 2^-51 * bound more
    # for the rounding of v -+ e itself, keep fl32(fl64(v - e)) <= fl32(exact) <= fl32(fl64(v + e))
    e = bound * ((2 * r + 6) * 2.0 ** -52) + 2.0 ** -148
    np.subtract(v, e, out=out, casting="unsafe")
    np.add(v, e, out=high, casting="unsafe")
    np.not_equal(out, high, out=same)
    rows = np.flatnonzero(same.any(axis=1))  # a few elements of a few rows: only those rows are searched
    if not len(rows):
        return rows
    cols = same[rows]
    return (rows[:, None] * same.shape[1] + np.arange(same.shape[1]))[cols]


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
    a64 = a.astype(np.float64)
    b64 = np.ascontiguousarray(b, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        a_abs, b_abs = np.abs(a64), np.abs(b64)
        a_sum, a_max = a_abs.sum(axis=1), a_abs.max(axis=1)  # sum|a_ik||b_kj| <= sum_k|a_ik| * max_k|b_kj|, and
        b_max, b_sum = b_abs.max(axis=0).max(), b_abs.sum(axis=0).max()  # <= max_k|a_ik| * sum_k|b_kj|
    buf = _scratch(step * n)
    opened = []  # (flat indices in out, their float64 products) of every step: settled together after the loop
    with blas.one_thread(), np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, m, step):
            i1 = min(m, i + step)
            p = i1 - i
            v = buf.v[:p * n].reshape(p, n)
            for k in range(0, p, _GEMM_ROWS):
                np.matmul(a64[i + k:min(i1, i + k + _GEMM_ROWS)], b64, out=v[k:k + _GEMM_ROWS])
            x, y = float(a_sum[i:i1].max() * b_max), float(a_max[i:i1].max() * b_sum)
            bound = min(x, y) if math.isfinite(x) and math.isfinite(y) else math.inf  # a NaN, an infinity: each alone
            block = out[i:i1]
            tmp = block if block.flags.c_contiguous else buf.low[:p * n].reshape(p, n)  # a strided out: via scratch
            open_ = _step_into(tmp, v, buf.high[:p * n].reshape(p, n), buf.same[:p * n].reshape(p, n), bound, r)
            if tmp is not block:
                block[...] = tmp
            if len(open_):
                opened.append((open_ + i * n, v.reshape(-1)[open_]))
        if opened:
            flat = np.concatenate([o[0] for o in opened])
            _settle(out, np.concatenate([o[1] for o in opened]), a, b, a64, b64, flat // n, flat % n)
    return out


__all__ = ["exact_product", "exact_sum_float32", "round_to_float32"]
