"""PaddleNLP 2.8 Llama -> Hugging Face ``LlamaForCausalLM``.

PaddleNLP names its tensors ``llama.layers.N...`` and stores Linear weights as ``[in, out]``: each
Linear needs a rename and a transpose.
"""
from __future__ import annotations

from .base import LAYER, MappingContext, Preset, drop, linear, register, rename


def _llama(ctx: MappingContext) -> list:
    p, L = "llama", LAYER
    out = [
        rename(f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
        rename(f"{p}.norm.weight", "model.norm.weight"),
    ]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(rename(f"{p}.layers.{L}.{norm}.weight", f"model.layers.{L}.{norm}.weight"))
    for mod, projs in (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down"))):
        for proj in projs:
            out.append(linear(f"{p}.layers.{L}.{mod}.{proj}_proj.weight", f"model.layers.{L}.{mod}.{proj}_proj.weight"))
    if ctx.has("lm_head.weight"):
        out.append(drop("lm_head.weight") if ctx.tied else linear("lm_head.weight", "lm_head.weight"))
    return out


LLAMA = register(Preset(
    name="llama_paddlenlp",
    description="PaddleNLP 2.8 Llama (llama.* names, [in, out] Linear) -> HF LlamaForCausalLM",
    framework="paddlenlp",
    classes=("LlamaForCausalLM",),
    hf_architecture="LlamaForCausalLM",
    hf_model_type="llama",
    statements=_llama,
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                        r"|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
))
