"""PaddleFormers 1.2 models whose own Hugging Face mapping is wrong.

Gemma3 (text): PaddleFormers' ``_gen_inv_aoa_config`` splits the fused gate/up of layer 0 only
(later layers' ``up_gate_proj`` pass through under the Paddle name and their gate/up are missing),
and drops ``lm_head.weight`` even for untied models. Its model also applies one rotary embedding
(``rope_parameters``) to every layer, sliding-window layers included, where transformers uses
``rope_local_base_freq`` for those: config.json must say what PaddleFormers computed.
"""
from __future__ import annotations

import copy

from .base import LAYER, MappingContext, Preset, drop, linear, register, rename


def _gemma3(ctx: MappingContext) -> list:
    L, n = LAYER, int(ctx.get("num_hidden_layers"))
    heads, kv = int(ctx.get("num_attention_heads")), int(ctx.get("num_key_value_heads"))
    out = [rename("model.embed_tokens.weight", "model.embed_tokens.weight"), rename("model.norm.weight", "model.norm.weight")]
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        out.append(rename(f"model.layers.{L}.{norm}.weight", f"model.layers.{L}.{norm}.weight"))
    for norm in ("q_norm", "k_norm"):
        out.append(rename(f"model.layers.{L}.self_attn.{norm}.weight", f"model.layers.{L}.self_attn.{norm}.weight"))
    out += [linear(f"model.layers.{L}.self_attn.o_proj.weight", f"model.layers.{L}.self_attn.o_proj.weight"),
            linear(f"model.layers.{L}.mlp.down_proj.weight", f"model.layers.{L}.mlp.down_proj.weight")]
    # q/k/v interleaved per key-value head: Paddle's own fused_qkv macro knows the layout
    # (its num_key_value_groups is the number of key-value heads)
    qkv = [f"model.layers.{L}.self_attn.{x}_proj" for x in "qkv"]
    out.append(f"model.layers.{L}.self_attn.qkv_proj.weight -> {', '.join(q + '.weight' for q in qkv)}, fused_qkv, "
               f"num_heads={heads}, num_key_value_groups={kv}")
    if ctx.has_any(r"self_attn\.qkv_proj\.bias$"):
        out.append(f"model.layers.{L}.self_attn.qkv_proj.bias -> {', '.join(q + '.bias' for q in qkv)}, fused_qkv, "
                   f"num_heads={heads}, num_key_value_groups={kv}, axis=0")
        out.append(rename(f"model.layers.{L}.self_attn.o_proj.bias", f"model.layers.{L}.self_attn.o_proj.bias"))
    out.append(f"model.layers.{L}.mlp.up_gate_proj.weight -> model.layers.{L}.mlp.gate_proj.weight, "
               f"model.layers.{L}.mlp.up_proj.weight, fused_ffn")
    # the split parts are intermediates, which $LAYER_ID (expanded over source names) cannot reach
    for i in range(n):
        for name in [f"self_attn.{x}_proj" for x in "qkv"] + ["mlp.gate_proj", "mlp.up_proj"]:
            out.append(linear(f"model.layers.{i}.{name}.weight", f"model.layers.{i}.{name}.weight"))
    out.append(drop("lm_head.weight") if ctx.tied else rename("lm_head.weight", "lm_head.weight"))
    return out


def _gemma3_config(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    rope = dict(out.get("rope_parameters") or {"rope_type": "default", "rope_theta": out.get("rope_theta", 10000.0)})
    rope.setdefault("rope_type", "default")
    theta = rope.get("rope_theta", out.get("rope_theta"))
    # PaddleFormers 1.2 rotates every layer with these parameters: say so for both layer types
    out["rope_parameters"] = {"full_attention": dict(rope), "sliding_attention": dict(rope)}
    out["rope_theta"] = out["rope_local_base_freq"] = theta
    for key in ("rope_scaling", "_sliding_window_pattern", "fuse_rms_norm", "paddleformers_version"):
        out.pop(key, None)
    return out


GEMMA3 = register(Preset(
    name="gemma3_paddleformers",
    description="PaddleFormers 1.2 Gemma3 (text) -> HF Gemma3ForCausalLM (replaces PaddleFormers' own mapping, "
                "which drops layers' gate/up and the untied LM head)",
    framework="paddleformers",
    classes=("Gemma3ForCausalLM",),
    hf_architecture="Gemma3ForCausalLM",
    hf_model_type="gemma3_text",
    statements=_gemma3,
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(input_layernorm|post_attention_layernorm"
                        r"|pre_feedforward_layernorm|post_feedforward_layernorm|self_attn\.(q_norm|k_norm|[qkvo]_proj)"
                        r"|mlp\.(gate|up|down)_proj))\.(weight|bias)|lm_head\.weight)$",
    hf_config=_gemma3_config,
))
