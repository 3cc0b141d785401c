"""Casts on the host (host/casts.py, host/lazy.py): the bits of Paddle's CPU cast kernel, on every class
of value, through every kernel (ml_dtypes where installed, numpy integer arithmetic, Paddle's own), for
every layout the writer meets (contiguous, transposed, sliced), whole or block by block."""
from __future__ import annotations

import numpy as np
import pytest

from paddle_fullparam_callbacks.host import casts
from paddle_fullparam_callbacks.host.lazy import CastArray
from paddle_fullparam_callbacks.host.pool import WorkerPool, using

paddle = pytest.importorskip("paddle")


def paddle_cast(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """What Paddle's CPU kernel gives (the reference: snapshots had these bits before host/casts.py)."""
    out = casts.to_paddle(np.array(arr, order="C"), src).astype(dst)
    return out.view("uint16").numpy() if dst == "bfloat16" else out.numpy()


def float32_classes() -> np.ndarray:
    """Every sign and exponent (all 65536 upper halves) with the lower halves that decide the rounding
    (0, 1, just under, at and just over the tie, all ones), plus random bit patterns: zeros, denormals,
    normals, ties to even and to odd, values that round up to infinity, infinities, and NaNs of every
    payload and both signs (quiet and signalling)."""
    upper = np.arange(1 << 16, dtype=np.uint32) << 16
    lowers = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    grid = (upper[:, None] | lowers[None, :]).reshape(-1)
    rand = np.random.default_rng(0).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([grid, rand])
    values = bits.view(np.float32)
    assert np.isnan(values).sum() > 1000 and (values == np.inf).any() and (values == -np.inf).any()
    tiny = np.abs(values) < np.finfo(np.float32).tiny
    assert (tiny & (values != 0)).sum() > 1000  # denormals
    return values


KERNELS = ["numpy"] + (["ml_dtypes"] if casts._BF16 is not None else [])


@pytest.mark.parametrize("kernel", KERNELS)
def test_float32_to_bfloat16_equals_paddle_on_every_class_of_value(kernel):
    x = float32_classes()
    want = paddle_cast(x, "float32", "bfloat16")
    got = np.empty(x.shape, np.uint16)
    casts.f32_to_bf16(got, x, use_ml_dtypes=kernel == "ml_dtypes")
    assert np.array_equal(got, want), f"{(got != want).sum()} values differ, e.g. " \
        f"{[(hex(b), hex(g), hex(w)) for b, g, w in zip(x.view(np.uint32)[got != want][:4], got[got != want], want[got != want])]}"
    # round to nearest, ties to even (torch's rule) and Paddle's NaN, checked by hand on a few
    cases = {0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0x3F808001: 0x3F81, 0x7F7F8000: 0x7F80, 0x80000000: 0x8000,
             0x00008000: 0x0000, 0x00018000: 0x0002, 0xFFC00001: 0x7FFF, 0x7F800001: 0x7FFF, 0xFF800000: 0xFF80}
    src = np.array(list(cases), np.uint32).view(np.float32)
    out = np.empty(src.shape, np.uint16)
    casts.f32_to_bf16(out, src, use_ml_dtypes=kernel == "ml_dtypes")
    assert [hex(v) for v in out] == [hex(v) for v in cases.values()]


def test_bfloat16_to_float32_and_paddle_kernel_pairs_equal_paddle():
    every_bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(every_bf16.shape, np.float32)
    casts.cast_into(got, every_bf16, "bfloat16", "float32")
    assert got.view(np.uint32).tobytes() == paddle_cast(every_bf16, "bfloat16", "float32").view(np.uint32).tobytes()
    x = float32_classes()[::7]
    for dst, storage in (("float16", np.float16), ("float64", np.float64)):  # through Paddle's own kernel
        got = np.empty(x.shape, storage)
        casts.cast_into(got, x, "float32", dst)
        assert got.tobytes() == paddle_cast(x, "float32", dst).tobytes(), dst


def _layouts():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((300, 1024)).astype(np.float32)
    base.reshape(-1)[::97] = np.nan
    return {"contiguous": base, "transposed": base.T, "column-slab": base[:, 100:700].T, "rows": base[7:200],
            "stepped": base[::3, ::2], "3d": base.reshape(300, 32, 32).transpose(2, 0, 1), "0d": base[5, 5]}


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_cast_into_any_layout_and_lazy_blocks_equal_paddle(dst):
    storage = np.uint16 if dst == "bfloat16" else np.float16
    pool = WorkerPool(3)
    try:
        with using(pool):
            for name, src in _layouts().items():
                src = np.asarray(src)
                want = paddle_cast(src, "float32", dst).view(np.uint16).tobytes()
                got = np.empty(src.shape, storage)
                casts.cast_into(got, src, "float32", dst)
                assert got.view(np.uint16).tobytes() == want, name
                lazy = CastArray(src, "float32", dst, np.dtype(storage))
                assert lazy.materialize().view(np.uint16).tobytes() == want, name  # blocks on the workers
                if src.ndim:  # rows one block at a time, as the writer's workers compute them
                    rows = [np.asarray(lazy.rows(r, min(len(src), r + 37))) for r in range(0, len(src), 37)]
                    assert np.concatenate(rows).view(np.uint16).tobytes() == want, name
                back = CastArray(lazy, dst, "float32", np.dtype(np.float32))  # a lazy array of a lazy array
                assert np.asarray(back).tobytes() == paddle_cast(np.asarray(lazy), dst, "float32").tobytes(), name
    finally:
        pool.close()
