"""Mutation tests of the mapping check (``models/mapping_check.py``): one statement of a real mapping
broken, of each kind of operation, and the export refused before the first byte.

Two ways in: the PaddleNLP presets on the zoo's recorded models (``tests/unit/data/preset_sources.json``:
names, shapes, configs; the preset's statements and ``config.json`` as an export computes them, the
destination map through Paddle's AOAEngine, then the check an export runs), and PaddleFormers'
own mappings given back as ``export.aoa`` through a real export of a real model.

Beyond any check without the values: two tensors of one shape exchanged (q and k of a model with as
many key-value heads as heads, gate and up halves, two experts). The zoo compares logits with
transformers, which catches those.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.paddleformers

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "zoo"))

from paddle_fullparam_callbacks.assemble import build_destination_map  # noqa: E402
from paddle_fullparam_callbacks.assemble.mapping import MappingError  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama  # noqa: E402
from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.export import ExportError, ExportSession  # noqa: E402
from paddle_fullparam_callbacks.models.mapping_check import check_layout  # noqa: E402
from paddle_fullparam_callbacks.models.mappings import PRESETS, MappingContext  # noqa: E402
from paddle_fullparam_callbacks.models.model_info import build_model_source  # noqa: E402


SOURCES = json.loads((HERE / "unit" / "data" / "preset_sources.json").read_text())


def _shard_info(sources: dict) -> dict:
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    return {k: [ShardedWeightDesc(key=k, local_shape=tuple(shape), global_shape=tuple(shape),
                                  global_offset=(0,) * len(shape), dtype=dtype)]
            for k, (shape, dtype) in sources.items()}


def _preset_case(case_id: str, mutate=None):
    """Check the preset's mapping of a recorded zoo model, its statements first passed through ``mutate``."""
    case = SOURCES[case_id]
    preset = PRESETS[case["preset"]]
    ctx = MappingContext(dict(case["config"]), case["tied"], {k: tuple(v[0]) for k, v in case["sources"].items()},
                         dict(case["parallel"]))
    statements = preset.statements(ctx)
    if mutate is not None:
        changed = mutate(list(statements))
        assert changed != statements, "the mutation changed nothing"
        statements = changed
    aoa = {"aoa_statements": statements}
    hf = preset.hf_config(dict(case["config"])) if preset.hf_config else dict(case["config"])
    dmap = build_destination_map(_shard_info(case["sources"]), aoa)
    check_layout(dmap, aoa, hf, f"preset {preset.name}, mutated")


def _replace_one(pattern: str, repl: str):
    def mutate(statements):
        hits = [i for i, s in enumerate(statements) if re.search(pattern, s)]
        assert hits, f"no statement matches {pattern!r}"
        statements[hits[0]] = re.sub(pattern, repl, statements[hits[0]])
        return statements
    return mutate


def _swap(a: str, b: str):
    def mutate(statements):
        return [s.replace(a, "\0").replace(b, a).replace("\0", b) if a in s or b in s else s for s in statements]
    return mutate


def _last_expert_dropped(statements):
    """Layer 0's w1 written expert by expert, the last one dropped."""
    out = []
    for s in statements:
        if s.startswith("mixtral.layers.0.block_sparse_moe.experts.$EXPERT_ID.w1.weight^T"):
            out += [f"mixtral.layers.0.block_sparse_moe.experts.{e}.w1.weight^T -> "
                    f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(3)]
            out.append("mixtral.layers.0.block_sparse_moe.experts.3.w1.weight -> _")
        else:
            out.append(s)
    return out


PRESET_MUTATIONS = [
    # (kind, zoo case, mutation, what the refusal names)
    ("a transpose left out", "pnlp-llama-unfused-gqa",
     _replace_one(r"llama\.layers\.0\.mlp\.gate_proj\.weight\^T", "llama.layers.0.mlp.gate_proj.weight"),
     r"model.layers.0.mlp.gate_proj.weight is \[64, 128\], expected \[128, 64\]"),
    ("q and k swapped", "pnlp-llama-unfused-gqa",
     _swap("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"),
     r"model.layers.1.self_attn.k_proj.weight is \[64, 64\], expected \[32, 64\]"),
    ("a fused projection split on the wrong axis", "pnlp-llama-bothfused-gqa",
     _replace_one(r"(__tmp__\.llama\.layers\.0\.self_attn\.qkv_proj\.weight\.T -> .*), axis=0$", r"\1, axis=1"),
     r"model.layers.0.self_attn.q_proj.weight is \[\d+, \d+\], expected \[64, 64\]"),
    ("an expert left out", "pnlp-mixtral", _last_expert_dropped,
     r"model.layers.0.block_sparse_moe.experts.N.w1.weight: experts \[3\] missing \(the config has 4 experts\)"),
    ("a temporary left as a destination", "pnlp-chatglm2-glm",
     _replace_one(r"-> model\.layers\.0\.mlp\.down_proj\.weight$", "-> __tmp__.down"),
     r"\['__tmp__.down'\] are named by no statement"),
]


@pytest.mark.parametrize("kind, case_id, mutate, refusal", PRESET_MUTATIONS, ids=[m[0] for m in PRESET_MUTATIONS])
def test_a_broken_preset_is_refused(kind, case_id, mutate, refusal):
    _preset_case(case_id)  # unbroken, it passes
    with pytest.raises(MappingError, match=refusal):
        _preset_case(case_id, mutate)


def _export(model, out, statements):
    cfg = load_config(None, [f"output_dir={out}", f"export.aoa={json.dumps(statements)}"])
    session = ExportSession(cfg, out)
    session.start()
    try:
        return session.export(build_model_source(model, cfg), 1, reason="test")
    finally:
        session.close()


def _qwen2():
    from run_zoo import install_shims

    install_shims(("gpt_provider",))
    from paddleformers.transformers.qwen2.configuration import Qwen2Config
    from paddleformers.transformers.qwen2.modeling import Qwen2ForCausalLMDeprecated

    return Qwen2ForCausalLMDeprecated(Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=128, fuse_rms_norm=False))


def _glm4v_form(statements):
    """PaddleFormers' Glm4v-MoE form: the fused macro applied to the transposed tensor, with several
    destinations (the repair of the package covers this in the frameworks' own mappings, not in a user's)."""
    out = []
    for s in statements:
        m = re.match(r"^(\S+up_gate_proj\.weight) -> (.+), fused_ffn$", s)
        out.append(f"{m.group(1)}^T -> {m.group(2)}, fused_ffn" if m else s)
    return [s for s in out if not re.match(r"^\S+\.mlp\.(gate|up)_proj\.weight\^T -> ", s)]


MODEL_MUTATIONS = [
    ("PaddleFormers Llama, a transpose left out", lambda: make_tiny_llama(seed=2, tie_word_embeddings=False),
     lambda st: [s.replace("mlp.down_proj.weight^T ->", "mlp.down_proj.weight ->") for s in st],
     r"mlp.down_proj.weight is \[128, 64\], expected \[64, 128\]"),
    ("PaddleFormers Llama, a destination renamed to a temporary", lambda: make_tiny_llama(seed=2),
     lambda st: [s.replace("-> model.norm.weight", "-> tmp_norm") for s in st],
     r"\['tmp_norm'\] are named by no statement"),
    ("PaddleFormers Qwen2, the fused gate/up split after its transpose", _qwen2, _glm4v_form,
     r"would write a snapshot transformers cannot use"),
]


@pytest.mark.parametrize("kind, build, mutate, refusal", MODEL_MUTATIONS, ids=[m[0] for m in MODEL_MUTATIONS])
def test_a_broken_framework_mapping_is_refused_before_the_first_byte(tmp_path, kind, build, mutate, refusal):
    model = build()
    own = model._gen_inv_aoa_config(model.config)["aoa_statements"]
    assert _export(model, tmp_path / "intact", own).path is not None  # given back unbroken, it exports
    broken = mutate(list(own))
    assert broken != own
    with pytest.raises(ExportError, match=refusal):
        _export(model, tmp_path / "broken", broken)
    assert not (tmp_path / "broken").exists()  # refused at start: the directory it made is gone again
