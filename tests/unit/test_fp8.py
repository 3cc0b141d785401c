"""FP8 (export.quantization=fp8): the rule's arithmetic, its lazy form, the plan, the config, verify's check.

The bytes and scales of ``host/fp8.py`` are compared with an independent implementation of the rule
(``tests/_fp8_reference.py``) and with transformers' own ``Fp8Quantize`` (the ``hf`` environment, in a
subprocess), on weights that cover every class of value: zeros, subnormals, huge values, infinities,
NaNs of both signs, exact ties, bfloat16 input, dimensions that are not multiples of the block.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.config import ConfigError, load_config
from paddle_fullparam_callbacks.export.verify.quantized import check_fp8
from paddle_fullparam_callbacks.export.verify.snapshot import VerifyReport
from paddle_fullparam_callbacks.export.write.header import HeaderEntry
from paddle_fullparam_callbacks.host import fp8
from paddle_fullparam_callbacks.host.lazy import CastArray, LazyArray
from paddle_fullparam_callbacks.host.pool import WorkerPool, using
from paddle_fullparam_callbacks.host.quantize import Fp8Weight
from paddle_fullparam_callbacks.models.mappings.fp8 import DECLARATIONS, fp8_declaration
from paddle_fullparam_callbacks.assemble.mapping import MappingError
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan
from paddle_fullparam_callbacks.plan.quantization import misread, plan_fp8, scale_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _fp8_reference as ref  # noqa: E402

HF_CLIENT = Path(__file__).resolve().parents[1] / "hf_client" / "fp8_quantize.py"


def weight_cases() -> dict:
    """name -> (weight: float32, or bfloat16 bits as uint16; block)."""
    rng = np.random.default_rng(40)
    cases = {}
    for i, (shape, block) in enumerate([((256, 384), (128, 128)), ((200, 300), (128, 128)), ((129, 127), (128, 128)),
                                        ((7, 300), (128, 128)), ((1, 1), (128, 128)), ((96, 80), (16, 32)),
                                        ((33, 65), (1, 64)), ((64, 48), (64, 1))]):
        scale = 10.0 ** rng.uniform(-8, 3)
        cases[f"normal{i}"] = ((rng.standard_normal(shape) * scale).astype(np.float32), block)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    w[:128, :128] = 0.0  # a block of zeros: scale 1
    w[:128, 128:] = (rng.standard_normal((128, 128)) * 1e-40).astype(np.float32)  # subnormal: scale inf, zeros NaN
    with np.errstate(over="ignore"):
        w[128:, :128] *= np.float32(3e38)  # huge (some overflow to inf: scale 0)
    w[200, 200], w[201, 201], w[202, 202] = np.nan, -np.nan, -1e30  # NaN blocks: scale 1, clamped
    w[140:150, 140:150] = -0.0
    cases["special"] = (w, (128, 128))
    v = rng.standard_normal((130, 200)).astype(np.float32)
    v[:64, :64] = 1e-37  # max_abs below 448 / FLT_MAX: scale inf
    v[64:, 64:128] = -np.inf
    v[:64, 128:] = 1e-36
    cases["tiny-and-inf"] = (v, (64, 64))
    t = np.zeros((16, 16), np.float32)
    t[0, 0] = 448.0  # scale 1: the values below are rounded as they are
    ties = [1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 464.0, 0.0009765625, 240.0, -17.0, 2.0 ** -6 * 1.0625]
    t.reshape(-1)[1:1 + len(ties)] = ties
    t.reshape(-1)[20:30] = np.nextafter(np.float32(ties[:10] + [0.0] * (10 - len(ties[:10]))), np.float32(1e9))[:10]
    cases["ties"] = (t, (16, 16))
    bits = rng.integers(0, 2 ** 16, (160, 96)).astype(np.uint16)  # every class of bfloat16, NaNs included
    cases["bf16-bits"] = (bits, (64, 32))
    cases["bf16-normal"] = ((rng.standard_normal((96, 70)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16),
                            (32, 32))
    return cases


def _f32(w):
    return ref.widen_bf16(w) if w.dtype == np.uint16 else w


@pytest.mark.parametrize("name", sorted(weight_cases()))
def test_bytes_and_scales_equal_the_rule_written_independently(name):
    w, block = weight_cases()[name]
    with np.errstate(all="ignore"):
        q, inv = fp8.quantize(_f32(w), block)
        rq, rinv = ref.quantize(_f32(w), block)
    assert inv.shape == scale_shape(w.shape, block) and inv.dtype == np.float32
    np.testing.assert_array_equal(inv.view(np.uint32), rinv.view(np.uint32))
    np.testing.assert_array_equal(q, rq)


@pytest.mark.hf_client
def test_bytes_and_scales_equal_transformers_fp8quantize(tmp_path, hf_python):
    cases = weight_cases()
    np.savez(tmp_path / "in.npz", **{n: w for n, (w, _) in cases.items()},
             **{n + ".block": np.array(b) for n, (_, b) in cases.items()})
    run = subprocess.run([hf_python, str(HF_CLIENT), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = np.load(tmp_path / "out.npz")
    for name, (w, block) in cases.items():
        with np.errstate(all="ignore"):
            q, inv = fp8.quantize(_f32(w), block)
        np.testing.assert_array_equal(inv.view(np.uint32), theirs[name + ".inv"].view(np.uint32), err_msg=name)
        np.testing.assert_array_equal(q, theirs[name + ".q"], err_msg=name)


def test_the_scale_is_torchs_reciprocal_times_448_not_a_division():
    """448 / m in torch is reciprocal(m) * 448, two roundings: a true division differs for some blocks."""
    m = np.random.default_rng(1).uniform(1e-3, 10, 100_000).astype(np.float32)
    scale, inv = fp8.scales_of(m)
    two_step = (np.float32(1) / m).astype(np.float32) * np.float32(448)
    assert np.array_equal(scale, two_step)
    assert 0.1 < np.mean(scale != (np.float32(448) / m)) < 0.5  # the division would differ this often
    assert np.array_equal(inv, np.float32(1) / scale)
    s0, inv0 = fp8.scales_of(np.array([0.0, np.nan], np.float32))
    assert s0.tolist() == [1.0, 1.0] and inv0.tolist() == [1.0, 1.0]


def test_the_e4m3_cast_on_every_top_half_and_low_bits():
    """Every float32 whose top 16 bits are any of the 65536 patterns, with low halves that make exact values,
    ties and near-ties: the cast equals the independent rounding (clamped to 448, NaN kept with its sign)."""
    high = np.arange(65536, dtype=np.uint32) << 16
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF], np.uint32)
    y = (high[:, None] | lows[None, :]).reshape(-1).view(np.float32)
    out = np.empty(y.shape, np.uint8)
    fp8.encode_e4m3(out, y)
    with np.errstate(invalid="ignore"):
        expected = np.vectorize(ref.e4m3_byte, otypes=[np.uint8])(np.where(np.isnan(y), y, np.clip(y, -448, 448)))
    np.testing.assert_array_equal(out, expected)


def test_decode_and_dequantize_agree_with_the_reference():
    w = np.random.default_rng(2).standard_normal((70, 90)).astype(np.float32)
    q, inv = fp8.quantize(w, (32, 64))
    np.testing.assert_array_equal(fp8.dequantize(q, inv, (32, 64)), ref.dequantize(q, inv, (32, 64)))
    assert np.max(np.abs(fp8.dequantize(q, inv, (32, 64)) - w)) <= np.max(np.abs(w)) / 16  # e4m3: 3 mantissa bits


def test_bfloat16_is_widened_exactly_whatever_the_kernel(monkeypatch):
    """Every bfloat16 pattern (NaN payloads included) widened to the float32 of its 16 bits shifted, with ml_dtypes'
    kernel where it is installed and numpy's shift without it."""
    from paddle_fullparam_callbacks.host import quantize

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = bits.astype(np.uint32) << 16
    for kernel in (quantize._BF16, None):
        monkeypatch.setattr(quantize, "_BF16", kernel)
        np.testing.assert_array_equal(quantize.widened(bits, "bfloat16", "test").view(np.uint32), want)
        np.testing.assert_array_equal(quantize.widened(bits[::-1], "bfloat16", "test").view(np.uint32), want[::-1])


class _Lazy(LazyArray):
    """A lazy array of its own (as a LoRA merge is one): values computed from a plain array, row by row."""

    def __init__(self, values, r0=0, r1=None):
        self.values, self.r0 = values, r0
        self.r1 = len(values) if r1 is None else r1
        self.shape, self.dtype = (self.r1 - r0, values.shape[1]), values.dtype

    def rows(self, r0, r1):
        return _Lazy(self.values, self.r0 + r0, self.r0 + r1)

    def fill(self, out):
        out[...] = self.values[self.r0:self.r1]


def _weights_of(make, rows_at_a_time):
    """An Fp8Weight's bytes materialized in row blocks of the given size, on two threads."""
    with using(WorkerPool(2)):
        q = make()
        out = np.empty(q.weight.shape, np.uint8)
        for r in range(0, q.weight.shape[0], rows_at_a_time):
            q.weight.rows(r, min(r + rows_at_a_time, q.weight.shape[0])).fill(out[r:r + rows_at_a_time])
        return out, q.scale_inv, q.weight.materialize()


@pytest.mark.parametrize("rows_at_a_time", [1, 37, 1000])
def test_the_writers_lazy_form_gives_the_same_bytes(rows_at_a_time):
    """Transposed views (a Linear weight in Hugging Face's layout), casts to bfloat16 (scales from the cast's
    float32 source), lazy arrays of other kinds, any row blocks: the bytes of the whole tensor's rule."""
    rng = np.random.default_rng(3)
    paddle_layout = rng.standard_normal((150, 200)).astype(np.float32)  # [in, out]
    hf = paddle_layout.T  # [out, in], a strided view
    block = (64, 48)
    expected = fp8.quantize(np.ascontiguousarray(hf), block)
    cast = CastArray(hf, "float32", "bfloat16", np.dtype(np.uint16))
    bf16 = cast.materialize()
    expected_bf16 = fp8.quantize(ref.widen_bf16(bf16), block)
    for make, (eq, einv) in ((lambda: Fp8Weight(hf, "float32", block), expected),
                             (lambda: Fp8Weight(_Lazy(np.ascontiguousarray(hf)), "float32", block), expected),
                             (lambda: Fp8Weight(cast, "bfloat16", block), expected_bf16),
                             (lambda: Fp8Weight(bf16, "bfloat16", block), expected_bf16)):
        q, inv, whole = _weights_of(make, rows_at_a_time)
        np.testing.assert_array_equal(inv, einv)
        np.testing.assert_array_equal(q, eq)
        np.testing.assert_array_equal(whole, eq)


@pytest.mark.parametrize("use_ml_dtypes", [True, False])
def test_a_bfloat16_cast_with_nans_and_infinities_in_some_blocks(use_ml_dtypes, monkeypatch):
    """Blocks with a NaN are rounded with Paddle's NaN (0x7FFF: the e4m3 byte 0x7F, whatever the NaN's sign); the
    others are rounded without looking for one: the bytes of the whole tensor's rule on the cast values."""
    from paddle_fullparam_callbacks.host import casts

    if not use_ml_dtypes:
        monkeypatch.setattr(casts, "_BF16", None)
    w = np.random.default_rng(6).standard_normal((96, 200)).astype(np.float32)
    w[5, 7], w[70, 150], w[40, 20] = np.nan, -np.nan, np.inf
    paddle_layout = np.ascontiguousarray(w.T)
    for src in (w, paddle_layout.T):  # row-major, and a transposed view (read in memory order)
        cast = CastArray(src, "float32", "bfloat16", np.dtype(np.uint16))
        bits = cast.materialize()
        assert bits[5, 7] == bits[70, 150] == 0x7FFF  # Paddle's NaN
        with np.errstate(all="ignore"):
            eq, einv = ref.quantize(ref.widen_bf16(bits), (32, 64))
        q, inv, whole = _weights_of(lambda: Fp8Weight(cast, "bfloat16", (32, 64)), 17)
        np.testing.assert_array_equal(inv, einv)
        np.testing.assert_array_equal(q, eq)
        assert q[5, 7] == q[70, 150] == 0x7F


def test_a_float16_cast_takes_its_scales_from_the_float32_source():
    w = (np.random.default_rng(4).standard_normal((64, 64)) * 3000).astype(np.float32)
    w[0, 0] = 70000.0  # beyond float16: the cast gives inf, so the block's scale is 0 as for the cast values
    cast = CastArray(w, "float32", "float16", np.dtype(np.float16))
    q = Fp8Weight(cast, "float16", (32, 32))
    with np.errstate(all="ignore"):
        eq, einv = ref.quantize(cast.materialize().astype(np.float32), (32, 32))
        got = q.weight.materialize()
    np.testing.assert_array_equal(q.scale_inv, einv)
    np.testing.assert_array_equal(got, eq)


# ---- the plan -----------------------------------------------------------------------------------------------
def test_plan_replaces_the_weight_and_keeps_its_scale_in_its_file():
    specs = [TensorSpec(f"l.{i}.weight", (300, 200), "bfloat16") for i in range(4)] + [TensorSpec("norm", (300,), "bfloat16")]
    p = plan_fp8(specs, [s.name for s in specs[:4]], ["lm_head"], (128, 128))
    out = p.specs(specs)
    assert [(s.name, s.dtype, s.shape) for s in out[:2]] == [("l.0.weight", "float8_e4m3fn", (300, 200)),
                                                            ("l.0.weight_scale_inv", "float32", (3, 2))]
    assert p.config() == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    assert p.misread == [s.name for s in specs[:4]]  # 300 and 200 span two blocks each, neither a multiple
    for limit in (60_000, 60_025, 100_000, 10**9):  # a file never splits a weight from its scale
        plan = build_export_plan(out, limit)
        for s in out:
            if s.companion_of:
                assert plan.slots[s.name].file_index == plan.slots[s.companion_of].file_index
                # after every weight (the scales would wait for the last one), and aligned: 4 x 60000 + 600 bytes
                assert plan.slots[s.name].begin >= max(plan.slots[t.name].end for t in out if not t.companion_of
                                                       and plan.slots[t.name].file_index == plan.slots[s.name].file_index)
                assert plan.slots[s.name].begin % 4 == 0
        assert "l.0.weight_scale_inv" not in plan.assembled() and "l.0.weight" in plan.assembled()
        assert plan.companions == {f"l.{i}.weight_scale_inv": f"l.{i}.weight" for i in range(4)}
    assert misread((200, 256), (128, 128)) and not misread((64, 96), (128, 128)) and not misread((256, 128), (128, 128))


@pytest.mark.parametrize("spec, message", [
    (TensorSpec("w", (4,), "float32"), "only 2-D floating weights"),
    (TensorSpec("w", (4, 4), "int64"), "only 2-D floating weights"),
    (TensorSpec("w", (0, 4), "float32"), "only 2-D floating weights"),
    (TensorSpec("x", (4, 4), "float32"), "has no such tensor"),
])
def test_plan_refuses_what_cannot_be_quantized(spec, message):
    with pytest.raises(ValueError, match=message):
        plan_fp8([spec], ["w"], [], (128, 128))
    with pytest.raises(ValueError, match="already has a tensor 'w_scale_inv'"):
        plan_fp8([TensorSpec("w", (4, 4), "float32"), TensorSpec("w_scale_inv", (1, 1), "float32")], ["w"], [], (2, 2))


# ---- the recipe keys and the declarations ---------------------------------------------------------------------
@pytest.mark.parametrize("override, key, message", [
    ("export.quantization=fp4", "export.quantization", "must be one of none, fp8; got 'fp4'"),
    ("export.quantization=true", "export.quantization", "YAML boolean"),
    ("export.quantization_block=[0,128]", "export.quantization_block", "two positive whole numbers"),
    ("export.quantization_block=128", "export.quantization_block", "two positive whole numbers"),
    ("export.quantization_block=[128,128,1]", "export.quantization_block", "two positive whole numbers"),
    ("export.quantization_block=[1.5,2]", "export.quantization_block", "two positive whole numbers"),
    ("export.quantization_block=[true,2]", "export.quantization_block", "two positive whole numbers"),
])
def test_bad_recipe_values_name_their_key(override, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [override])
    assert e.value.key == key


def test_fp8_needs_the_hugging_face_format():
    with pytest.raises(ConfigError, match="need export.format=hf_safetensors") as e:
        load_config(None, ["export.quantization=fp8", "export.format=paddle_safetensors"])
    assert e.value.key == "export.quantization"
    cfg = load_config(None, ["export.quantization=fp8", "export.quantization_block=[64, 32]"])
    assert cfg.export.quantization == "fp8" and cfg.export.quantization_block == [64, 32]
    assert load_config(None, []).export.quantization == "none"


def test_an_architecture_without_a_declaration_is_refused_naming_it():
    for arch in ("GPT2LMHeadModel", "GptOssForCausalLM", "SomethingNewForCausalLM"):
        with pytest.raises(ConfigError, match=f"fp8 is not available for {arch}") as e:
            fp8_declaration(arch)
        assert e.value.key == "export.quantization"


def test_a_declaration_selects_projections_never_embeddings_heads_norms_routers():
    names = [("model.embed_tokens.weight", (8, 4)), ("lm_head.weight", (8, 4)), ("model.norm.weight", (4,)),
             ("model.layers.0.self_attn.q_proj.weight", (4, 4)), ("model.layers.0.self_attn.q_proj.bias", (4,)),
             ("model.layers.0.mlp.gate.weight", (2, 4)), ("model.layers.0.mlp.experts.1.up_proj.weight", (2, 4)),
             ("model.layers.0.mlp.shared_expert.down_proj.weight", (4, 2)),
             ("model.layers.0.mlp.shared_expert_gate.weight", (1, 4)),
             ("model.layers.0.input_layernorm.weight", (4,))]
    quantized, skip = DECLARATIONS["Qwen2MoeForCausalLM"](names)
    assert quantized == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight",
                         "model.layers.0.mlp.shared_expert.down_proj.weight"]
    assert skip == ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"]
    with pytest.raises(MappingError, match="matches none of the snapshot's tensors"):
        DECLARATIONS["LlamaForCausalLM"]([("transformer.h.0.attn.c_attn.weight", (4, 4))])


# ---- verify ----------------------------------------------------------------------------------------------------
class _Snap:
    def __init__(self, config):
        self.config = config

    def names(self):
        return ["config.json"] if self.config is not None else []

    def read_json(self, name):
        return self.config


def _entries(**tensors):
    return {n.replace("__", "."): HeaderEntry(n.replace("__", "."), dt, shape, 0, 0) for n, (dt, shape) in tensors.items()}


QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
      "modules_to_not_convert": ["lm_head"]}


@pytest.mark.parametrize("config, tensors, errors", [
    ({"quantization_config": QC}, dict(a__weight=("F8_E4M3", (200, 300)), a__weight_scale_inv=("F32", (2, 3))), []),
    ({}, dict(a__weight=("F8_E4M3", (200, 300)), a__weight_scale_inv=("F32", (2, 3))), ["no quantization_config"]),
    ({"quantization_config": QC}, dict(a__weight=("F8_E4M3", (200, 300))), ["without its scale"]),
    ({"quantization_config": QC}, dict(a__weight=("F8_E4M3", (200, 300)), a__weight_scale_inv=("F32", (2, 2))),
     ["expected [2, 3]"]),
    ({"quantization_config": QC}, dict(a__weight=("F8_E4M3", (200, 300)), a__weight_scale_inv=("BF16", (2, 3))),
     ["the layout's scales are F32"]),
    ({"quantization_config": QC}, dict(a__weight=("BF16", (200, 300)), a__weight_scale_inv=("F32", (2, 3))),
     ["no tensor is F8_E4M3", "which is BF16, not F8_E4M3"]),
    ({"quantization_config": dict(QC, weight_block_size=[128])}, dict(a__weight=("F8_E4M3", (2, 3)),
                                                                   a__weight_scale_inv=("F32", (1, 1))),
     ["not two positive integers"]),
    ({"quantization_config": dict(QC, modules_to_not_convert=["a"])},
     dict(a__weight=("F8_E4M3", (2, 3)), a__weight_scale_inv=("F32", (1, 1))), ["whose weights are F8_E4M3"]),
    ({}, dict(a__weight=("BF16", (2, 3))), []),  # no FP8 at all: nothing to say
])
def test_verify_checks_the_fp8_layout(config, tensors, errors):
    report = VerifyReport("x")
    check_fp8(_Snap(config), _entries(**tensors), report)
    assert len(report.errors) == len(errors), report.errors
    for got, want in zip(report.errors, errors):
        assert want in got, report.errors
