"""The host byte path's chunked loops on both sides of their sizes (issue 46), against independent implementations.

- ``host/casts.py`` ``_SUB``: a cast goes ``_SUB`` elements (1-D) or ``_SUB // row`` rows at a time; a transposed
  source is cast in memory order into scratch first. Reference: Paddle's own cast kernel on a contiguous copy.
- ``host/copy.py`` ``STAGE_BYTES`` and ``_SMALL``: a transposed view is staged ``STAGE_BYTES // row`` source rows
  (at least 16) at a time, above ``_SMALL`` elements. Reference: numpy's copy (and ``+`` for ``add``).
- ``host/lazy.py`` ``MATERIALIZE_BLOCK``: a lazy array is computed in row blocks of that many bytes on the pool.
- ``export/session/host.py`` ``HostRing``: copies of random sizes into a ring smaller or larger than them, wrapping
  around; each live copy must keep its bytes while later ones are made (an overlap would show: every allocation is
  poisoned as it is handed out).

Every size is drawn from 1 to past the tensor's size; scratch, stage and ring memory are poisoned.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import paddle
from hypothesis import given
from hypothesis import strategies as st

from paddle_fullparam_callbacks.export.session.host import HostRing
from paddle_fullparam_callbacks.host import casts, copy, lazy
from paddle_fullparam_callbacks.host.casts import cast_into
from paddle_fullparam_callbacks.host.copy import copy_into
from paddle_fullparam_callbacks.host.lazy import CastArray
from paddle_fullparam_callbacks.host.poison import poisoned
from paddle_fullparam_callbacks.host.pool import WorkerPool, using

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _sizes import SETTINGS, finite_or_special, shrunk  # noqa: E402

_POOL = WorkerPool(2)
DTYPES = ("float32", "bfloat16", "float16", "float64")
STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16, "float64": np.float64}


def _storage_of(w32: np.ndarray, dtype: str) -> np.ndarray:
    """Values of every class in ``dtype``'s storage (bfloat16: truncated float32 bits, NaN payloads included)."""
    if dtype == "bfloat16":
        return (w32.view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(all="ignore"):
        return w32.astype(STORAGE[dtype])


def _paddle_cast(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Paddle's CPU cast of a contiguous copy, as ``dst``'s storage (bfloat16 sources widened first: exact)."""
    if src == "bfloat16":
        values, src = (values.astype(np.uint32) << 16).view(np.float32), "float32"
    out = paddle.to_tensor(np.ascontiguousarray(values)).astype(dst).numpy()
    return out.view(STORAGE[dst]) if out.dtype != STORAGE[dst] else out


def _view(values: np.ndarray, layout: str) -> np.ndarray:
    """The same values through a view of another memory layout."""
    if layout == "contiguous" or values.ndim == 1:
        return np.ascontiguousarray(values)
    if layout == "transposed":  # the last axes' memory order reversed: every axis permuted
        return np.ascontiguousarray(values.transpose(tuple(reversed(range(values.ndim))))).transpose(
            tuple(reversed(range(values.ndim))))
    wide = np.zeros(values.shape[:-1] + (values.shape[-1] * 2,), values.dtype)
    wide[..., ::2] = values
    return wide[..., ::2]


@st.composite
def cast_cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24 if ndim < 3 else 8), min_size=ndim, max_size=ndim)))
    size = int(np.prod(shape))
    return dict(shape=shape, src=draw(st.sampled_from(DTYPES)), dst=draw(st.sampled_from(DTYPES)),
                layout=draw(st.sampled_from(("contiguous", "transposed", "every-other"))),
                sub=draw(st.integers(1, size + 16)), specials=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(cast_cases())
def test_casts_at_any_step(case):
    rng = np.random.default_rng(case["seed"])
    values = _storage_of(finite_or_special(rng, case["shape"], case["specials"]), case["src"])
    want = _paddle_cast(values, case["src"], case["dst"]) if case["src"] != case["dst"] else values
    out = np.empty(case["shape"], STORAGE[case["dst"]])
    with shrunk(casts, _SUB=case["sub"]), poisoned(case["seed"]), np.errstate(all="ignore"):
        cast_into(out, _view(values, case["layout"]), case["src"], case["dst"])
    np.testing.assert_array_equal(out.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@st.composite
def copy_cases(draw):
    rows, cols = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    return dict(rows=rows, cols=cols, dtype=draw(st.sampled_from((np.uint8, np.uint16, np.float32, np.float64))),
                stage=draw(st.integers(1, rows * cols * 8 + 64)), small=draw(st.integers(0, rows * cols + 1)),
                gap=draw(st.integers(1, 3)), add=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


@SETTINGS
@given(copy_cases())
def test_staged_copies_at_any_stage_size(case):
    """A transposed view (with ``gap`` between memory rows) into file order, staged in blocks of any size."""
    rng = np.random.default_rng(case["seed"])
    memory = rng.integers(0, 250, (case["cols"] * case["gap"], case["rows"])).astype(case["dtype"])
    src = memory[::case["gap"]].T  # [rows, cols], columns contiguous
    base = rng.integers(0, 5, src.shape).astype(case["dtype"])
    dst = base.copy()
    with shrunk(copy, STAGE_BYTES=case["stage"], _SMALL=case["small"]), poisoned(case["seed"]):
        copy_into(dst, src, add=case["add"])
    np.testing.assert_array_equal(dst, base + src if case["add"] else src)


@SETTINGS
@given(st.integers(1, 40), st.integers(1, 30), st.integers(1, 5000), st.integers(0, 2**32 - 1))
def test_materialize_at_any_block(rows, cols, block, seed):
    """A lazy cast computed in row blocks of ``block`` bytes on two threads: Paddle's cast of the whole."""
    w = finite_or_special(np.random.default_rng(seed), (rows, cols), True)
    want = _paddle_cast(w, "float32", "bfloat16")
    with shrunk(lazy, MATERIALIZE_BLOCK=block), using(_POOL), poisoned(seed), np.errstate(all="ignore"):
        got = CastArray(np.ascontiguousarray(w.T).T, "float32", "bfloat16", np.dtype(np.uint16)).materialize()
    np.testing.assert_array_equal(got, want)


@SETTINGS
@given(st.integers(1, 4096), st.lists(st.tuples(st.integers(1, 900), st.integers(0, 3)), min_size=1, max_size=30),
       st.integers(0, 2**32 - 1))
def test_ring_copies_keep_their_bytes_whatever_the_ring_size(size, plan, seed):
    """Copies of random sizes (``plan``: bytes, how many of the oldest to free after it) into a ring of ``size``
    bytes: each is in the ring or refused (never waits: ``wait=False``), and every live copy still equals its
    source after every later allocation (allocations are poisoned: an overlap would overwrite one)."""
    rng = np.random.default_rng(seed)
    ring = HostRing(size, wait_s=0.0)
    live = []  # (copy, release, source)
    with poisoned(seed):
        for nbytes, frees in plan:
            source = rng.integers(0, 256, nbytes).astype(np.uint8)
            empty = not live
            view, token = ring.alloc(nbytes, wait=False)
            assert view is not None or not (empty and nbytes <= size), "an empty ring refused what it can hold"
            if view is not None:
                view[...] = source
                live.append((view, token, source))
            for held, _, want in live:
                np.testing.assert_array_equal(held, want)
            for _ in range(min(frees, len(live))):
                ring.free(live.pop(0)[1])
