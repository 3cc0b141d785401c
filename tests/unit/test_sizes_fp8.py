"""The FP8 fills on both sides of every size that cuts them (issue 46), against the rule written independently.

``host/quantize.py`` reads a weight in chunks of ``_CHUNK`` elements (memory order: runs of a transposed view's
columns, clipped at each block column's end; row order: rows of a cast), ``host/fp8.py`` scales and encodes in
steps of ``_SUB``, and the writer asks for any split of the rows. Here both constants are drawn from 1 up to past
the tensor's size, so chunks are smaller than, equal to and larger than blocks, and do not divide them; blocks,
shapes, strides, source dtypes and row splits are drawn by hypothesis; scratch memory is poisoned. The bytes and
scales must equal ``tests/_fp8_reference.py`` (plain loops, float64 rounding) on the values the rule quantizes.
The defect this guards: a chunk step that did not divide the block column left rows of the e4m3 output as the
scratch held them (37 % of Qwen2.5-7B's q/o/gate/up bytes).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from paddle_fullparam_callbacks.host import fp8, quantize
from paddle_fullparam_callbacks.host.lazy import CastArray, LazyArray
from paddle_fullparam_callbacks.host.poison import poisoned
from paddle_fullparam_callbacks.host.pool import WorkerPool, using
from paddle_fullparam_callbacks.host.quantize import Fp8Weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _fp8_reference as ref  # noqa: E402
from _sizes import SETTINGS, cut_points, finite_or_special, shrunk  # noqa: E402

_POOL = WorkerPool(2)
SOURCES = ("float32", "bfloat16", "float16", "float64", "cast-bfloat16", "cast-float16", "lazy")
LAYOUTS = ("rows", "transposed", "transposed-every-other-row", "every-other-column")


class _Lazy(LazyArray):
    """A lazy array of another kind than a cast (a LoRA merge is one): its values are computed twice."""

    def __init__(self, values):
        self.values, self.shape, self.dtype = values, values.shape, values.dtype

    def rows(self, r0, r1):
        return _Lazy(self.values[r0:r1])

    def fill(self, out):
        out[...] = self.values


def _paddle_cast(w: np.ndarray, dtype: str) -> np.ndarray:
    """Paddle's own CPU cast of float32 values (the rule's source for a cast), as float32 values."""
    t = paddle.to_tensor(np.ascontiguousarray(w)).astype(dtype)
    if dtype == "bfloat16":
        return ref.widen_bf16(t.numpy())  # Paddle gives bfloat16 as its uint16 bits
    return t.numpy().astype(np.float32)


def _laid_out(values: np.ndarray, layout: str) -> np.ndarray:
    """``values`` ([out, in]) as a view with the layout's strides, the same values."""
    if layout == "rows":
        return np.ascontiguousarray(values)
    if layout == "transposed":  # a Hugging Face Linear weight over Paddle's [in, out] memory
        return np.ascontiguousarray(values.T).T
    if layout == "transposed-every-other-row":  # memory rows with a gap between them
        wide = np.zeros((values.shape[1] * 2, values.shape[0]), values.dtype)
        wide[::2] = values.T
        return wide[::2].T
    wide = np.zeros((values.shape[0], values.shape[1] * 2), values.dtype)
    wide[:, ::2] = values
    return wide[:, ::2]


def _source(w32: np.ndarray, kind: str, layout: str):
    """(the source Fp8Weight gets, its Paddle dtype, the float32 values the rule quantizes)."""
    if kind == "float32":
        return _laid_out(w32, layout), "float32", w32
    if kind == "bfloat16":
        bits = (w32.view(np.uint32) >> 16).astype(np.uint16)  # any bfloat16 pattern: truncated float32
        return _laid_out(bits, layout), "bfloat16", ref.widen_bf16(bits)
    if kind == "float16":
        with np.errstate(all="ignore"):
            h = w32.astype(np.float16)
        return _laid_out(h, layout), "float16", h.astype(np.float32)
    if kind == "float64":
        d = w32.astype(np.float64) * (1 + 2.0 ** -30)  # not float32 values: the widening rounds them
        with np.errstate(all="ignore"):
            return _laid_out(d, layout), "float64", d.astype(np.float32)
    if kind.startswith("cast-"):
        dtype = kind[len("cast-"):]
        storage = np.uint16 if dtype == "bfloat16" else np.float16
        return (CastArray(_laid_out(w32, layout), "float32", dtype, np.dtype(storage)), dtype,
                _paddle_cast(w32, dtype))
    return _Lazy(np.ascontiguousarray(w32)), "float32", w32


@st.composite
def cases(draw):
    rows, cols = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    block = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    return dict(rows=rows, cols=cols, block=block, kind=draw(st.sampled_from(SOURCES)),
                layout=draw(st.sampled_from(LAYOUTS)), specials=draw(st.booleans()),
                chunk=draw(st.integers(1, rows * cols + 64)), sub=draw(st.integers(1, rows * cols + 64)),
                cuts=cut_points(draw, rows), seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(cases())
def test_fp8_bytes_and_scales_at_any_chunk_block_and_split(case):
    rng = np.random.default_rng(case["seed"])
    w32 = finite_or_special(rng, (case["rows"], case["cols"]), case["specials"])
    src, dtype, values = _source(w32, case["kind"], case["layout"])
    with np.errstate(all="ignore"):
        want_q, want_inv = ref.quantize(values, case["block"])
    got = np.empty(want_q.shape, np.uint8)
    cuts = case["cuts"]
    with shrunk(quantize, _CHUNK=case["chunk"]), shrunk(fp8, _SUB=case["sub"]), using(_POOL), \
            poisoned(case["seed"]), np.errstate(all="ignore"):
        q = Fp8Weight(src, dtype, case["block"])
        _POOL.run([(lambda a, b: lambda: q.weight.rows(a, b).fill(got[a:b]))(a, b) for a, b in zip(cuts, cuts[1:])])
    np.testing.assert_array_equal(q.scale_inv, want_inv)
    bad = np.flatnonzero(got.reshape(-1) != want_q.reshape(-1))
    assert not bad.size, (f"{bad.size} of {got.size} e4m3 bytes differ from the rule; first at "
                          f"{np.unravel_index(bad[0], got.shape)}: {got.reshape(-1)[bad[0]]:#x} for "
                          f"{want_q.reshape(-1)[bad[0]]:#x}")


def test_the_memory_order_fill_where_the_step_does_not_divide_the_block():
    """The defect of issue 46 at its smallest: 5 output rows per fill, a 7-element chunk (step 1 row of memory...
    up to the block's end), blocks of 3 columns of memory order: every byte equals the rule."""
    rng = np.random.default_rng(46)
    w = rng.standard_normal((5, 16)).astype(np.float32)
    hf = np.ascontiguousarray(w.T).T  # read in memory order
    want, _ = ref.quantize(w, (5, 3))
    for chunk in (5, 7, 10, 11, 15, 16, 80):  # steps of 1, 1, 2, 2, 3, 3 (= the block), 3 memory rows
        with shrunk(quantize, _CHUNK=chunk), poisoned(chunk):
            got = Fp8Weight(hf, "float32", (5, 3)).weight.materialize()
        np.testing.assert_array_equal(got, want, err_msg=f"_CHUNK={chunk}")
