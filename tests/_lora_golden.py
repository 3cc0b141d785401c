"""The LoRA merge's bits as a corpus of digests: every layout and block of the lazy-merge test
(``tests/unit/test_lora.py``) and inputs chosen to reach every branch of the product's rule (ties,
cancellation, exact sums, subnormals, overflow, NaNs and infinities, signed zeros, long and short r).

``tests/unit/data/lora_golden.json`` holds the digests computed by the code of issue 30's rule (commit
1c109ee, before issue 42 changed how the product is computed); ``tests/unit/test_lora_golden.py`` checks
today's code against them. Regenerate only to add cases, from a tree whose bits are known to be the rule's:

    PYTHONPATH=$PWD python tests/_lora_golden.py tests/unit/data/lora_golden.json
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

LAZY_SHAPES = ((1024, 2816, 16), (300, 200, 64), (37, 5, 1), (1, 9, 3), (8, 1, 2))  # test_lora.py's
WIDTHS = (1, 7, 64)


def rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def digest(x) -> str:
    x = np.ascontiguousarray(x)
    return hashlib.sha256(str(x.dtype).encode() + str(list(x.shape)).encode() + x.tobytes()).hexdigest()[:32]


def _coarse(x):  # bfloat16-born factors: 8-bit mantissas, sums land on float32 values and ties
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)


def product_inputs():
    """(name, a, b): float32 factors for the product alone."""
    rng = np.random.default_rng(42)
    out = [("random_23x40x17", rand((23, 40), 11), rand((40, 17), 12, 1e-3)),
           ("coarse_16x16x16", _coarse(rand((16, 16), 13)), _coarse(rand((16, 16), 14))),
           ("coarse_512x16x700", _coarse(rand((512, 16), 15)), _coarse(rand((16, 700), 16, 0.01))),
           ("r1_300x1x257", rand((300, 1), 17), rand((1, 257), 18)),
           ("r128_64x128x96", rand((64, 128), 19), rand((128, 96), 20, 0.05))]
    # exponents spread over 80 binades: cancellation, the exact path, sums the float64 product gets wrong
    ea, eb = rng.integers(-40, 40, (200, 16)), rng.integers(-40, 40, (16, 150))
    out.append(("wide_exponents", np.ldexp(rand((200, 16), 21), ea).astype(np.float32),
                np.ldexp(rand((16, 150), 22), eb).astype(np.float32)))
    # cancelling pairs with small remainders: results far below sum|a||b|
    a = rand((128, 16), 23)
    a[:, 8:] = -a[:, :8] * (1 + np.ldexp(rand((128, 8), 24), -20)).astype(np.float32)
    b = np.concatenate([rand((8, 96), 25)] * 2)
    out.append(("cancel_pairs", a, b))
    # integers: every sum exact; some of them ties after rounding to 24 bits
    out.append(("integers", rng.integers(-2**20, 2**20, (64, 16)).astype(np.float32),
                rng.integers(-2**12, 2**12, (16, 64)).astype(np.float32)))
    # subnormal and underflowing results, and overflow to infinity
    out.append(("subnormal", np.ldexp(rand((64, 16), 26), -70).astype(np.float32),
                np.ldexp(rand((16, 80), 27), -70).astype(np.float32)))
    out.append(("overflow", (rand((32, 16), 28) * 3e19).astype(np.float32), (rand((16, 40), 29) * 3e19).astype(np.float32)))
    # NaNs, infinities, signed zeros among ordinary values
    a, b = rand((40, 8), 30), rand((8, 50), 31)
    a[3, 2], a[5, :] = np.nan, 0.0
    b[1, 7], b[4, 9], b[:, 11] = np.inf, -np.inf, -0.0
    a[7, :] = -0.0
    out.append(("specials", a, b))
    return out


def merge_inputs():
    """(name, w, w_dtype, a, b, scaling)."""
    out = []
    for m, n, r in LAZY_SHAPES:
        w, a, b = rand((m, n), 6), rand((m, r), 7), rand((r, n), 8, 0.1)
        out.append((f"lazy_{m}x{n}x{r}_float32", w, "float32", a, b, 5 / 3))
        out.append((f"lazy_{m}x{n}x{r}_bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16), "bfloat16", a, b, 5 / 3))
    w = rand((96, 130), 40)
    out.append(("float16_weight", w.astype(np.float16), "float16", rand((96, 8), 41), rand((8, 130), 42, 0.1), 2.0))
    out.append(("rslora_scaling", rand((200, 300), 43), "float32", rand((200, 3), 44), rand((3, 300), 45), 5 / 3 ** 0.5))
    w = rand((256, 512), 46)  # W and the update of one size: the sum W + s * P rounds often
    out.append(("update_as_large_as_w", w, "float32", rand((256, 16), 47), rand((16, 512), 48, 0.25), 1.0))
    return out


def corpus() -> dict:
    """{case: digest} computed by the code on the path."""
    from paddle_fullparam_callbacks.host.casts import f32_to_bf16
    from paddle_fullparam_callbacks.host.lazy import CastArray
    from paddle_fullparam_callbacks.models.lora.merge import MergedArray, delta_hf, merged_block
    from paddle_fullparam_callbacks.models.lora.product import exact_product

    out = {}
    for name, a, b in product_inputs():
        with np.errstate(all="ignore"):
            out[f"product/{name}"] = digest(exact_product(a, b))
            out[f"product_other_layout/{name}"] = digest(exact_product(b.T, a.T))
            half = a.shape[0] // 2  # a block of rows and of columns alone
            out[f"product_block/{name}"] = digest(exact_product(a[half:], b[:, 1:]))
    for name, w, w_dtype, a, b, s in merge_inputs():
        whole = merged_block(w, w_dtype, a, "float32", b, "float32", s)
        out[f"merged_block/{name}"] = digest(whole)
        out[f"delta_hf/{name}"] = digest(delta_hf(a, b, s))
        lazy = MergedArray(w, w_dtype, a, "float32", b, "float32", s)
        out[f"lazy/{name}"] = digest(np.asarray(lazy))
        if name.startswith("lazy_"):
            for layout, view in (("paddle", lazy), ("hf", lazy.T)):
                for width in WIDTHS:
                    rows = [np.asarray(view.rows(i, min(len(view), i + width))) for i in range(0, len(view), width)]
                    out[f"lazy_rows/{name}/{layout}/{width}"] = digest(np.concatenate(rows))
            if w_dtype == "float32":
                cast = CastArray(lazy.T, "float32", "bfloat16", np.dtype(np.uint16))
                rows = [np.asarray(cast.rows(i, min(len(cast), i + 5))) for i in range(0, len(cast), 5)]
                out[f"lazy_cast_bf16/{name}"] = digest(np.concatenate(rows))
                want = np.empty(whole.T.shape, np.uint16)
                f32_to_bf16(want, np.ascontiguousarray(whole.T))
                out[f"merged_cast_bf16/{name}"] = digest(want)
    return out


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(corpus(), indent=1, sort_keys=True) + "\n")
