"""A model's tensors (Hugging Face names, shapes, dtype) without the model: from a ``config.json``'s fields or
from a named set of shapes, for predictions made before any job starts (``paddle-fullparam plan --model``).

Pure: a config is a dict the caller has read. Llama-family decoders (Llama, Mistral, Qwen2, Mixtral-style
mixtures of experts) are described; other architectures are read from a ``model.safetensors.index.json``
and its files' headers by the CLI instead.
"""
from __future__ import annotations

from typing import Dict, Mapping, Tuple

Shapes = Dict[str, Tuple[int, ...]]

PRESETS: Dict[str, dict] = {
    "Llama-2-7B": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, torch_dtype="bfloat16"),
    "Llama-2-13B": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, torch_dtype="bfloat16"),
    "Llama-2-70B": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, torch_dtype="bfloat16"),
    "Llama-3-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, torch_dtype="bfloat16"),
    "Mixtral-8x7B": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, torch_dtype="bfloat16"),
}


def _int(cfg: Mapping, *keys, default=None) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    if default is None:
        raise ValueError(f"the config has none of {list(keys)}")
    return default


def decoder_shapes(cfg: Mapping) -> Tuple[Shapes, str]:
    """(HF name -> shape, dtype) of a Llama-family decoder described by config fields.

    >>> shapes, dtype = decoder_shapes(dict(vocab_size=8, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
    ...                                     num_attention_heads=2, num_key_value_heads=1))
    >>> shapes["model.layers.0.self_attn.k_proj.weight"], shapes["lm_head.weight"], dtype
    ((2, 4), (8, 4), 'bfloat16')
    """
    vocab, h = _int(cfg, "vocab_size"), _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=h // heads)
    experts = _int(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    inter = _int(cfg, "moe_intermediate_size", "intermediate_size") if experts else _int(cfg, "intermediate_size")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    shapes: Shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * head_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * head_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * head_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * head_dim)
        if experts:
            shapes[p + "block_sparse_moe.gate.weight"] = (experts, h)
            for e in range(experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                shapes[q + "w1.weight"] = (inter, h)
                shapes[q + "w3.weight"] = (inter, h)
                shapes[q + "w2.weight"] = (h, inter)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes, dtype


def preset(name: str) -> Tuple[Shapes, str]:
    """A named set of shapes (``PRESETS``), matched without regard to case."""
    for k, cfg in PRESETS.items():
        if k.lower() == name.lower():
            return decoder_shapes(cfg)
    raise ValueError(f"unknown model {name!r}; named ones: {', '.join(PRESETS)} (or give a config.json or a "
                     "model.safetensors.index.json)")


__all__ = ["PRESETS", "Shapes", "decoder_shapes", "preset"]
