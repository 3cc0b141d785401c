"""The repair of fused splits in a framework's mapping (``models/mappings/repairs_fused.py``), on
PaddleFormers 1.2's own statement forms (no Paddle needed)."""
from __future__ import annotations

from paddle_fullparam_callbacks.models.mappings.repairs_fused import repair_fused_splits

P = "model.language_model.layers"
QKV_T = (f"{P}.$LAYER_ID.self_attn.qkv_proj.weight^T -> {P}.$LAYER_ID.self_attn.q_proj.weight, "
         f"{P}.$LAYER_ID.self_attn.k_proj.weight, {P}.$LAYER_ID.self_attn.v_proj.weight, fused_qkv, num_heads=4, "
         "num_key_value_groups = 2")
EXPERTS = (f"{P}.$LAYER_ID.mlp.experts.$EXPERT_ID.up_gate_proj.weight -> {P}.$LAYER_ID.mlp.experts.$EXPERT_ID.gate_proj.weight, "
           f"{P}.$LAYER_ID.mlp.experts.$EXPERT_ID.up_proj.weight, fused_ffn")
SOURCES = {f"{P}.{i}.self_attn.qkv_proj.weight": (64, 128) for i in range(2)}
SOURCES.update({f"{P}.1.mlp.experts.{e}.up_gate_proj.weight": (64, 64) for e in range(2)})


def test_transpose_then_split_becomes_split_then_transpose_per_destination():
    out, repairs = repair_fused_splits([QKV_T], SOURCES)
    assert out[0] == QKV_T.replace("qkv_proj.weight^T ->", "qkv_proj.weight ->")
    assert out[1:] == [f"{P}.{i}.self_attn.{x}_proj.weight^T -> {P}.{i}.self_attn.{x}_proj.weight"
                       for i in range(2) for x in "qkv"]
    assert len(repairs) == 1 and "split first, then each part transposed" in repairs[0]


def test_the_one_destination_form_of_phi3():
    s = "model.layers.0.mlp.gate_up_proj.weight^T -> model.layers.0.mlp.gate_up_proj.weight, fused_ffn"
    out, _ = repair_fused_splits([s], {"model.layers.0.mlp.gate_up_proj.weight": (64, 256)})
    assert out == ["model.layers.0.mlp.gate_up_proj.weight -> model.layers.0.mlp.gate_up_proj.weight, fused_ffn",
                   "model.layers.0.mlp.gate_up_proj.weight^T -> model.layers.0.mlp.gate_up_proj.weight"]


def test_parts_of_a_linear_weight_never_transposed_get_transposed():
    linear = set(SOURCES)
    out, repairs = repair_fused_splits([EXPERTS], SOURCES, linear)
    assert out[0] == EXPERTS
    assert out[1:] == [f"{P}.1.mlp.experts.{e}.{x}_proj.weight^T -> {P}.1.mlp.experts.{e}.{x}_proj.weight"
                       for e in range(2) for x in ("gate", "up")]
    assert "never transpose their parts" in repairs[0]


def test_right_mappings_are_left_alone():
    split = f"{P}.$LAYER_ID.self_attn.qkv_proj.weight -> {P}.$LAYER_ID.self_attn.q_proj.weight, {P}.$LAYER_ID.self_attn.k_proj.weight, {P}.$LAYER_ID.self_attn.v_proj.weight, fused_qkv, num_heads=4, num_key_value_groups=2"
    later = [f"{P}.{i}.self_attn.{x}_proj.weight^T -> model.layers.{i}.self_attn.{x}_proj.weight" for i in range(2) for x in "qkv"]
    statements = [split, *later, "model.norm.weight^T -> model.norm.weight"]
    assert repair_fused_splits(statements, SOURCES, set(SOURCES)) == (statements, [])
    # not a Linear of the model (an expert bank stored [out, in] already): no evidence, no change
    assert repair_fused_splits([EXPERTS], SOURCES, set()) == ([EXPERTS], [])
    # a plain split of the transposed tensor names its axis: well defined, left as written
    axis = f"{P}.0.self_attn.qkv_proj.weight^T -> {P}.0.a.weight, {P}.0.b.weight, axis=1"
    assert repair_fused_splits([axis], SOURCES, set(SOURCES)) == ([axis], [])
