"""PaddleFormers 1.2 models whose own Hugging Face mapping is wrong.

Gemma3 (text): PaddleFormers' ``_gen_inv_aoa_config`` splits the fused gate/up of layer 0 only
(later layers' ``up_gate_proj`` pass through under the Paddle name and their gate/up are missing),
and drops ``lm_head.weight`` even for untied models. Its model also applies one rotary embedding
(``rope_parameters``) to every layer, sliding-window layers included, where transformers uses
``rope_local_base_freq`` for those: config.json must say what PaddleFormers computed.
"""
from __future__ import annotations

import copy

from .base import MappingContext, Preset, register
from .builders import AS_IS, LINEAR, PaddleMacro, layers, lm_head, table


def _qkv_heads(ctx: MappingContext) -> dict:
    # Paddle's num_key_value_groups is the number of key-value heads
    return {"num_heads": int(ctx.get("num_attention_heads")), "num_key_value_groups": int(ctx.get("num_key_value_heads"))}


_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "self_attn.q_norm", "self_attn.k_norm")
_GEMMA3_LAYER = [
    *[(norm, AS_IS) for norm in _NORMS],
    ("self_attn.o_proj", LINEAR),
    ("mlp.down_proj", LINEAR),
    # q/k/v interleaved per key-value head, gate/up halves: Paddle's own macros know the layouts
    ("self_attn.qkv_proj", "self_attn.{}_proj", PaddleMacro("fused_qkv", "qkv", _qkv_heads)),
    ("mlp.up_gate_proj", "mlp.{}_proj", PaddleMacro("fused_ffn", ("gate", "up"))),
]


def _gemma3(ctx: MappingContext) -> list:
    return (table(ctx, [("model.embed_tokens", AS_IS), ("model.norm", AS_IS)])
            + layers(ctx, "model.layers", "model.layers", _GEMMA3_LAYER)
            + lm_head(ctx))


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
