"""LoRA, one part at a time: the recipe keys, the merge arithmetic, the PEFT adapter's derivation from a
name mapping, the checkpoint layers (no model, no Paddle tensors: milliseconds)."""
from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import numpy as np
import pytest

from paddle_fullparam_callbacks.assemble.mapping import DestinationMap
from paddle_fullparam_callbacks.config import ConfigError, load_config
from paddle_fullparam_callbacks.models.lora.adapter import (
    Desc, Entry, adapter_config, adapter_map, adapter_settings, peft_scaling, target_modules,
)
from paddle_fullparam_callbacks.models.lora.files import StoredLora, lora_settings, stored_layers
from paddle_fullparam_callbacks.models.lora.layers import LoraError
from paddle_fullparam_callbacks.host import blas
from paddle_fullparam_callbacks.models.lora.merge import MergedArray, as_float32, delta_hf, merged_block
from paddle_fullparam_callbacks.models.lora.product import exact_product
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec


# ---- recipe keys ---------------------------------------------------------------------------------

def test_lora_keys_default_and_choices():
    cfg = load_config(None, [])
    assert (cfg.export.lora, cfg.export.peft_adapter) == ("merge", "none")
    assert load_config(None, ["export.lora=base", "export.peft_adapter=inside"]).export.lora == "base"


@pytest.mark.parametrize("override, message", [
    ("export.lora=merged", r"export.lora: must be one of merge, base; got 'merged'"),
    ("export.peft_adapter=beside", r"export.peft_adapter: must be one of none, inside; got 'beside'"),
])
def test_lora_keys_refuse_unknown_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_peft_adapter_needs_hf_names():
    with pytest.raises(ConfigError, match="export.peft_adapter: a PEFT adapter holds Hugging Face names: it needs "
                                          "export.format=hf_safetensors, not 'paddle_safetensors'"):
        load_config(None, ["export.peft_adapter=inside", "export.format=paddle_safetensors"])


# ---- the merge -------------------------------------------------------------------------------------

def _rand(shape, seed, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _f32_nearest(x: Fraction) -> float:
    """The float32 nearest the rational ``x``, ties to even, by integer arithmetic (the test's own rounding,
    independent of ``product.round_to_float32``): x = n * 2^e with 2^23 <= |n| < 2^24 (or e = -149 below)."""
    if x == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(x))) - 23, -149)
    while abs(x) / Fraction(2) ** e >= 2**24:  # log2 of a Fraction is a float: settle the exponent exactly
        e += 1
    while e > -149 and abs(x) / Fraction(2) ** e < 2**23:
        e -= 1
    n = round(x / Fraction(2) ** e)  # Python rounds a Fraction half to even, exactly
    return math.inf * (1 if x > 0 else -1) if abs(n) * Fraction(2) ** e >= 2**128 else float(n * Fraction(2) ** e)


def _rule_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The rule, by its definition: each element the float32 nearest the exact sum of its products."""
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            out[i, j] = _f32_nearest(sum((Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a[i], b[:, j])),
                                         Fraction(0)))
    return out


def _bits(x) -> bytes:
    return np.ascontiguousarray(x, np.float32).tobytes()


@pytest.mark.parametrize("terms, want", [
    ([1.0, 2.0**-24], 1.0),  # a tie between 1 and 1 + 2^-23: to the even one
    ([1.0 + 2.0**-23, 2.0**-24], 1.0 + 2.0**-22),  # a tie from the odd side: up
    ([1.0, 2.0**-24, 2.0**-60], 1.0 + 2.0**-23),  # just past the tie (float64 loses the 2^-60: the exact path)
    ([1.0, 2.0**-24, -(2.0**-60)], 1.0),  # just short of it
    ([2.0**30, -(2.0**30), 2.0**-30], 2.0**-30),  # cancellation: nothing of the big terms is left
    ([3.0e38, 3.0e38], math.inf),  # past the largest float32
    ([-0.0, -0.0], 0.0),  # an exact zero is +0.0
])
def test_the_product_is_the_float32_nearest_the_exact_sum(terms, want):
    a = np.array([terms], np.float32)
    b = np.ones((len(terms), 1), np.float32)
    got = exact_product(a, b)
    assert _bits(got) == _bits([[want]]) == _bits(_rule_product(a, b)), (got, want)
    assert _bits(exact_product(b.T, a.T)) == _bits(got)  # the same sum in the other layout


def test_the_product_follows_the_rule_on_random_and_low_precision_inputs():
    """Random float32 factors, and bfloat16-like ones (8-bit mantissas: many sums land exactly on a float32
    or on a tie), against the rule computed by its definition; no BLAS result is the reference."""
    a, b = _rand((23, 40), 11), _rand((40, 17), 12, 1e-3)
    assert _bits(exact_product(a, b)) == _bits(_rule_product(a, b))
    coarse = lambda x: (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # noqa: E731
    a2, b2 = coarse(_rand((16, 16), 13)), coarse(_rand((16, 16), 14))
    assert _bits(exact_product(a2, b2)) == _bits(_rule_product(a2, b2))
    nan = exact_product(np.array([[np.nan, 1.0]], np.float32), np.ones((2, 2), np.float32))
    assert np.isnan(nan).all()


def test_merged_block_is_w_plus_scaled_update_in_pefts_order():
    w, a, b = _rand((6, 5), 0), _rand((6, 3), 1), _rand((3, 5), 2)
    s = 5 / 3  # inexact in binary: the scalar is applied as float32, after the product
    got = merged_block(w, "float32", a, "float32", b, "float32", s)
    assert got.flags.c_contiguous and got.dtype == np.float32
    delta = _rule_product(b.T, a.T) * np.float32(s)  # peft's order: (B^T @ A^T) * s, then W^T + delta
    assert np.array_equal(got, (w.T + delta).T)
    assert _bits(delta_hf(a, b, s)) == _bits(delta)
    assert np.allclose(got, w + s * (a.astype(np.float64) @ b), atol=1e-6)


def test_a_block_merges_with_its_rows_of_a_and_columns_of_b_to_the_same_bits():
    w, a, b = _rand((8, 12), 3), _rand((8, 40), 4), _rand((40, 12), 5)  # r = 40: blocks of a BLAS sgemm differ
    whole = merged_block(w, "float32", a, "float32", b, "float32", 2.0)
    block = merged_block(w[4:, 6:], "float32", a[4:], "float32", b[:, 6:], "float32", 2.0)
    assert np.array_equal(block, whole[4:, 6:])  # r is never split: a tensor-parallel rank's block merges alone


@pytest.mark.parametrize("m, n, r", [(1024, 2816, 16), (300, 200, 64), (37, 5, 1), (1, 9, 3), (8, 1, 2)])
def test_the_lazy_merge_has_merged_blocks_bits_in_any_layout_and_block(m, n, r):
    """The export's merge (MergedArray: each block computed alone on the workers) equals the whole merge bit for
    bit, in Paddle's layout and transposed, in blocks of any width, for float32 and bfloat16 weights, whatever
    OpenBLAS's thread count (the product's rule: no BLAS bits reach the result); the thread count comes back."""
    w, a, b = _rand((m, n), 6), _rand((m, r), 7), _rand((r, n), 8, 0.1)
    before = blas.threads()
    if m * n <= 2000:  # the merge's first step is the rule's product, checked by the definition where it is quick
        assert _bits(merged_block(np.zeros_like(w), "float32", a, "float32", b, "float32", 1.0)) == _bits(
            _rule_product(a, b))
    for w_dtype, wt in (("float32", w), ("bfloat16", (w.view(np.uint32) >> 16).astype(np.uint16))):
        whole = merged_block(wt, w_dtype, a, "float32", b, "float32", 5 / 3)
        if w_dtype == "bfloat16":  # merged in float32, cast once: Paddle's rounding (host/casts.py)
            bits = np.empty(whole.shape, np.uint16)
            from paddle_fullparam_callbacks.host.casts import f32_to_bf16

            f32_to_bf16(bits, whole)
            whole = bits
        lazy = MergedArray(wt, w_dtype, a, "float32", b, "float32", 5 / 3)
        assert np.asarray(lazy).tobytes() == whole.tobytes()
        for view, want in ((lazy, whole), (lazy.T, whole.T)):
            for width in (1, 7, 64):
                rows = [np.asarray(view.rows(i, min(len(view), i + width))) for i in range(0, len(view), width)]
                assert np.concatenate(rows).tobytes() == np.ascontiguousarray(want).tobytes(), (w_dtype, width)
        if w_dtype == "float32":  # merged, then cast to the snapshot's dtype: a lazy array of a lazy array
            from paddle_fullparam_callbacks.host.casts import f32_to_bf16
            from paddle_fullparam_callbacks.host.lazy import CastArray

            want = np.empty(whole.T.shape, np.uint16)
            f32_to_bf16(want, np.ascontiguousarray(whole.T))
            cast = CastArray(lazy.T, "float32", "bfloat16", np.dtype(np.uint16))
            rows = [np.asarray(cast.rows(i, min(len(cast), i + 5))) for i in range(0, len(cast), 5)]
            assert np.asarray(cast).tobytes() == np.concatenate(rows).tobytes() == want.tobytes()
        del lazy, view, rows
    assert blas.threads() == before
    if blas.threads() is not None:  # BLAS left free to thread its float64 product (1, then 2 threads): same bits
        from paddle_fullparam_callbacks.models.lora import product as product_module

        api, want = blas._find(), exact_product(a, b)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(product_module.blas, "one_thread", contextlib.nullcontext)
                for n_threads in (1, 2):
                    api[0](n_threads)
                    assert _bits(exact_product(a, b)) == _bits(want), n_threads
        finally:
            api[0](before)


def test_bfloat16_is_widened_exactly_and_bad_shapes_are_refused():
    bits = np.array([0x3F80, 0xBF00, 0x4049], dtype=np.uint16)
    assert as_float32(bits, "bfloat16").tolist() == [1.0, -0.5, 3.140625]
    with pytest.raises(ValueError, match="cannot be merged"):
        as_float32(np.zeros(2, np.int64), "int64")
    with pytest.raises(ValueError, match=r"do not fit: W \[2, 3\], A \[2, 1\], B \[1, 4\]"):
        merged_block(np.zeros((2, 3), np.float32), "float32", np.zeros((2, 1), np.float32), "float32",
                     np.zeros((1, 4), np.float32), "float32", 1.0)
    assert delta_hf(np.ones((2, 1), np.float32), np.ones((1, 3), np.float32), 0.5).shape == (3, 2)


# ---- the adapter from a mapping -------------------------------------------------------------------

def _entry(key, src_off, src_shape, src_glob, dst, dst_off, dst_glob, pp=("[1, 0]",)):
    local = tuple(reversed(src_shape)) if pp else tuple(src_shape)
    return Entry(Desc(key, tuple(src_shape), tuple(src_glob), tuple(src_off), "float32"),
                 Desc(dst, local, tuple(dst_glob), tuple(dst_off)), tuple(pp))


def _fused_qkv_map():
    """A fused [in=4, out=6] weight split per head into q (4 rows: heads at columns 0:2 and 3:5), k, v."""
    w = "l.qkv.weight"
    entries = {
        "m.q.weight": [_entry(w, (0, 0), (4, 2), (4, 6), "m.q.weight", (0, 0), (4, 4)),
                       _entry(w, (0, 3), (4, 2), (4, 6), "m.q.weight", (2, 0), (4, 4))],
        "m.k.weight": [_entry(w, (0, 2), (4, 1), (4, 6), "m.k.weight", (0, 0), (1, 4))],
        "m.v.weight": [_entry(w, (0, 5), (4, 1), (4, 6), "m.v.weight", (0, 0), (1, 4))],
        "m.norm.weight": [_entry("l.norm.weight", (0,), (4,), (4,), "m.norm.weight", (0,), (4,), pp=())],
    }
    specs = [TensorSpec("m.q.weight", (4, 4), "float32"), TensorSpec("m.k.weight", (1, 4), "float32"),
             TensorSpec("m.v.weight", (1, 4), "float32"), TensorSpec("m.norm.weight", (4,), "float32")]
    return DestinationMap(specs, entries, None)


LAYER = StoredLora("l.qkv", "l.qkv.weight", "l.qkv.lora_A", "l.qkv.lora_B", r=2, alpha=4, scaling=2.0)
INFO = {"l.qkv.lora_A": [Desc("l.qkv.lora_A", (4, 2), (4, 2), (0, 0), "float32")],
        "l.qkv.lora_B": [Desc("l.qkv.lora_B", (2, 6), (2, 6), (0, 0), "float32")]}


def test_fused_weight_gets_a_repeated_and_b_columns_in_the_weights_order():
    dmap = _fused_qkv_map()
    adapter = adapter_map(dmap, INFO, [LAYER])
    p = "base_model.model.m.{}.lora_{}.weight"
    assert sorted(adapter.names) == sorted(p.format(m, x) for m in "qkv" for x in "AB")
    for m in "qkv":
        (a,) = adapter.entries[p.format(m, "A")]
        assert (a.source_slice.key, a.source_slice.local_shape, a.target_slice.global_shape) == ("l.qkv.lora_A", (4, 2), (2, 4))
    q = adapter.entries[p.format("q", "B")]
    assert [(e.source_slice.global_offset, e.source_slice.local_shape, e.target_slice.global_offset) for e in q] == [
        ((0, 0), (2, 2), (0, 0)), ((0, 3), (2, 2), (2, 0))]
    assert adapter.spec_by_name[p.format("q", "B")].shape == (4, 2)
    assert target_modules(dmap, adapter) == ["k", "q", "v"]


def test_adapter_refuses_what_peft_cannot_hold():
    dmap = _fused_qkv_map()
    dmap.entries["m.q.weight"].append(_entry("l.other.weight", (0, 0), (4, 0), (4, 6), "m.q.weight", (4, 0), (4, 4)))
    with pytest.raises(LoraError, match=r"'m.q.weight' is made of \['l.other.weight', 'l.qkv.weight'\], 1 of them "
                                        "with LoRA: peft has one LoRA module per weight"):
        adapter_map(dmap, INFO, [LAYER])
    dmap = _fused_qkv_map()
    dmap.entries["m.k.weight"] = [_entry("l.qkv.weight", (0, 2), (4, 1), (4, 6), "m.k.weight", (0, 0), (1, 4), pp=())]
    with pytest.raises(LoraError, match="'m.k.weight' is not a transpose of 'l.qkv.weight'"):
        adapter_map(dmap, INFO, [LAYER])


def test_partial_targets_are_named_in_full():
    dmap = _fused_qkv_map()
    dmap.specs.append(TensorSpec("n.q.weight", (4, 4), "float32"))
    dmap.spec_by_name["n.q.weight"] = dmap.specs[-1]
    assert target_modules(dmap, adapter_map(_fused_qkv_map(), INFO, [LAYER])) == ["k", "m.q", "v"]


def test_adapter_settings_reproduce_the_layers_scaling_or_refuse():
    rs = StoredLora("x", "x.weight", "x.lora_A", "x.lora_B", 3, 5, 5 / math.sqrt(3))
    assert adapter_settings([rs]) == (3, 5, True) and peft_scaling(3, 5, True) == rs.scaling
    assert adapter_settings([LAYER]) == (2, 4, False)
    with pytest.raises(LoraError, match="differ in"):
        adapter_settings([LAYER, rs])
    with pytest.raises(LoraError, match="scaling 1.0 is neither lora_alpha/r nor lora_alpha/sqrt"):
        adapter_settings([StoredLora("y", "y.weight", "y.lora_A", "y.lora_B", 4, 8, 1.0)])
    with pytest.raises(LoraError, match="PiSSA layers"):
        adapter_settings([StoredLora("y", "y.weight", "y.lora_A", "y.lora_B", 4, 4, 1.0, pissa=True)])
    cfg = adapter_config((4, 8, False), ["q_proj"])
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["use_rslora"], cfg["target_modules"]) == (
        "LORA", 4, 8, False, ["q_proj"])


# ---- checkpoint layers ---------------------------------------------------------------------------

def test_stored_layers_pair_tensors_with_their_weight_and_scaling():
    lora = {"a.q.lora_A": (8, 4), "a.q.lora_B": (4, 6)}
    base = {"a.q.weight": (8, 6), "a.norm.weight": (8,)}
    (lay,) = stored_layers(lora, base, lora_settings({"lora_alpha": 8, "rslora": True, "r": 4}, "cfg"))
    assert (lay.name, lay.weight_key, lay.r, lay.scaling) == ("a.q", "a.q.weight", 4, 8 / math.sqrt(4))
    with pytest.raises(LoraError, match=r"LoRA layer 'a.q': \['a.q.lora_B'\] missing"):
        stored_layers({"a.q.lora_A": (8, 4)}, base, {"lora_alpha": 8})
    with pytest.raises(LoraError, match="do not fit its weight"):
        stored_layers({"a.q.lora_A": (8, 4), "a.q.lora_B": (4, 5)}, base, {"lora_alpha": 8})
    with pytest.raises(LoraError, match="lora_alpha is None, not a positive number"):
        lora_settings({"r": 4}, "lora_config.json")
