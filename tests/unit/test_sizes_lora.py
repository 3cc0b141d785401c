"""The LoRA merge's chunked product on both sides of its sizes (issue 46), against the rule computed by hand.

``models/lora/product.py`` goes ``_ROWS_ELEMENTS // n`` rows at a time, each step in BLAS calls of ``_GEMM_ROWS``
rows, with one error bound per step; ``MergedArray`` is filled in any row split of the writer, transposed or not,
adding ``W`` through the copy stage (``STAGE_BYTES``) and casting back in ``_SUB`` steps. Every one of those sizes is
drawn from 1 to past the tensor; the scratch and stage memory is poisoned. The reference: each element of ``A @ B``
as the float32 nearest to the exact rational sum (Python's ``Fraction``), then ``* float32(s)`` and ``+ W`` rounded
once each (numpy float32), then Paddle's cast to the weight's dtype.
"""
from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from paddle_fullparam_callbacks.host import casts, copy
from paddle_fullparam_callbacks.host.poison import poisoned
from paddle_fullparam_callbacks.host.pool import WorkerPool, using
from paddle_fullparam_callbacks.models.lora import product
from paddle_fullparam_callbacks.models.lora.merge import MergedArray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _sizes import SETTINGS, cut_points, shrunk  # noqa: E402

_POOL = WorkerPool(2)


def nearest_float32(x: Fraction) -> np.float32:
    """The float32 nearest the rational ``x`` (ties to the even significand; +0.0 for zero)."""
    if x == 0:
        return np.float32(0.0)
    guess = np.float32(float(x))
    best = None
    for c in (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))):
        d = abs(Fraction(float(c)) - x)
        odd = int(np.array([c], np.float32).view(np.uint32)[0]) & 1
        if best is None or (d, odd) < best[0]:
            best = ((d, odd), c)
    return best[1]


def exact_products(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``A @ B`` element by element: the exact sum of float32 products, rounded once."""
    fa = [[Fraction(float(v)) for v in row] for row in a]
    fb = [[Fraction(float(v)) for v in col] for col in b.T]
    return np.array([[nearest_float32(sum((x * y for x, y in zip(ra, cb)), Fraction(0))) for cb in fb] for ra in fa],
                    np.float32).reshape(a.shape[0], b.shape[1])


def _values(rng, shape, kind):
    if kind == "ties":  # 1 + k 2^-12: sums of such products often land on a float32 midpoint (the exact paths)
        return (1 + rng.integers(-64, 64, shape) * 2.0 ** -12).astype(np.float32)
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)


def _as(values32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the storage of ``dtype`` (rounded by Paddle), and back to float32 exactly."""
    if dtype == "float32":
        return values32
    out = paddle.to_tensor(values32).astype(dtype).numpy()
    return out


def _widen(storage: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (storage.astype(np.uint32) << 16).view(np.float32)
    return storage.astype(np.float32)


@st.composite
def merges(draw):
    m, n, r = draw(st.integers(1, 24)), draw(st.integers(1, 24)), draw(st.integers(1, 8))
    transposed = draw(st.booleans())
    return dict(m=m, n=n, r=r, transposed=transposed, kind=draw(st.sampled_from(("normal", "ties"))),
                w_dtype=draw(st.sampled_from(("float32", "bfloat16", "float16"))),
                ab_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
                scaling=draw(st.sampled_from((1.0, 2.0, 0.3, 16 / 7))),
                rows_elements=draw(st.integers(1, m * n + 8)), gemm_rows=draw(st.integers(1, 20)),
                stage=draw(st.integers(1, m * n * 4 + 64)), sub=draw(st.integers(1, m * n + 8)),
                cuts=cut_points(draw, n if transposed else m), seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(merges())
def test_merges_at_any_step_and_split(case):
    rng = np.random.default_rng(case["seed"])
    m, n, r = case["m"], case["n"], case["r"]
    w = _as(_values(rng, (m, n), "normal"), case["w_dtype"])  # Paddle's [in, out]
    a = _as(_values(rng, (m, r), case["kind"]), case["ab_dtype"])
    b = _as(_values(rng, (r, n), case["kind"]), case["ab_dtype"])
    ab32 = _widen(a, case["ab_dtype"]), _widen(b, case["ab_dtype"])
    merged = exact_products(*ab32) * np.float32(case["scaling"]) + _widen(w, case["w_dtype"])
    want = merged if case["w_dtype"] == "float32" else paddle.to_tensor(merged).astype(case["w_dtype"]).numpy()
    if case["transposed"]:
        want = np.ascontiguousarray(want.T)
    lazy = MergedArray(w, case["w_dtype"], a, case["ab_dtype"], b, case["ab_dtype"], case["scaling"])
    if case["transposed"]:
        lazy = lazy.T
    got = np.empty(want.shape, want.dtype)
    cuts = case["cuts"]
    with shrunk(product, _ROWS_ELEMENTS=case["rows_elements"], _GEMM_ROWS=case["gemm_rows"]), \
            shrunk(copy, STAGE_BYTES=case["stage"], _SMALL=0), shrunk(casts, _SUB=case["sub"]), using(_POOL), \
            poisoned(case["seed"]):
        _POOL.run([(lambda x, y: lambda: lazy.rows(x, y).fill(got[x:y]))(x, y) for x, y in zip(cuts, cuts[1:])])
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 30), st.integers(1, 12), st.integers(1, 1000), st.integers(1, 20),
       st.integers(0, 2**32 - 1))
def test_the_product_alone_at_any_step(m, n, r, rows_elements, gemm_rows, seed):
    """``exact_product`` into a strided ``out`` (the path through scratch) and a contiguous one, tie-prone values."""
    rng = np.random.default_rng(seed)
    a, b = _values(rng, (m, r), "ties"), _values(rng, (r, n), "ties")
    want = exact_products(a, b)
    wide = np.empty((m, 2 * n), np.float32)
    with shrunk(product, _ROWS_ELEMENTS=rows_elements, _GEMM_ROWS=gemm_rows), poisoned(seed):
        contiguous = product.exact_product(a, b)
        product.exact_product(a, b, out=wide[:, ::2])
    np.testing.assert_array_equal(contiguous, want)
    np.testing.assert_array_equal(wide[:, ::2], want)
