"""PaddleNLP 2.8 Bloom and RW -> Hugging Face ``BloomForCausalLM`` and ``FalconForCausalLM``.

- ``BloomForCausalLM``: same per-head ``[q, k, v]`` fused layout in both; the LM head
  (``lm_head.decoder_weight``) is always the word embedding.
- ``RWForCausalLM`` -> ``FalconForCausalLM`` (old decoder architecture only: that is all PaddleNLP's
  RW implements; ``n_head_kv`` is ignored by it, so the kv heads are ``n_head`` or 1 (multi_query)).
"""
from __future__ import annotations

from typing import List

from ._paddlenlp_common import _FW, _IDS, _head, _layers, _norm, _pick, _refuse, _weight_bias
from .base import MappingContext, Preset, register, rename


# ---- Bloom -> BloomForCausalLM ---------------------------------------------------------------

def _bloom_problems(c: dict) -> List[str]:
    p = []
    if c.get("use_long_sequence_strategies"):
        p.append("use_long_sequence_strategies=True (its alibi is not Bloom's)")
    return p


def _bloom_hf(c: dict) -> dict:
    _refuse("BloomForCausalLM", _bloom_problems(c))
    out = _pick(c, ("vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon", "initializer_range",
                    "apply_residual_connection_post_layernorm", "hidden_dropout", "attention_dropout",
                    "pretraining_tp", "slow_but_exact") + _IDS)
    out["use_cache"] = True
    return out


def _bloom(ctx: MappingContext) -> list:
    _refuse("BloomForCausalLM", _bloom_problems(ctx.config))
    p, t = "bloom", "transformer"
    out = [rename(f"{p}.word_embeddings.weight", f"{t}.word_embeddings.weight")]
    out += _norm(ctx, f"{p}.word_embeddings_layernorm", f"{t}.word_embeddings_layernorm")
    out += _norm(ctx, f"{p}.ln_f", f"{t}.ln_f")
    for i in _layers(ctx, f"{p}.h."):
        s, d = f"{p}.h.{i}", f"{t}.h.{i}"
        out += _norm(ctx, f"{s}.input_layernorm", f"{d}.input_layernorm")
        out += _norm(ctx, f"{s}.post_attention_layernorm", f"{d}.post_attention_layernorm")
        # fused qkv: [heads, (q|k|v), head_dim] on the output axis in both frameworks
        out += _weight_bias(ctx, f"{s}.self_attention.query_key_value", f"{d}.self_attention.query_key_value", True)
        out += _weight_bias(ctx, f"{s}.self_attention.dense", f"{d}.self_attention.dense", True)
        out += _weight_bias(ctx, f"{s}.mlp.dense_h_to_4h", f"{d}.mlp.dense_h_to_4h", True)
        out += _weight_bias(ctx, f"{s}.mlp.dense_4h_to_h", f"{d}.mlp.dense_4h_to_h", True)
    # BloomLMHead.decoder_weight *is* the word embedding (BloomForCausalLM passes it in). The package
    # decides "tied" from config.tie_word_embeddings here (the head has no .weight): if that says
    # False, the untied HF head gets the same values, which is still exact.
    out += _head(ctx, "lm_head.decoder_weight")
    return out


BLOOM = register(Preset(
    name="bloom_paddlenlp",
    description="PaddleNLP 2.8 Bloom (bloom.* names, [in, out] Linear) -> HF BloomForCausalLM",
    framework=_FW,
    classes=("BloomForCausalLM",),
    hf_architecture="BloomForCausalLM",
    hf_model_type="bloom",
    statements=_bloom,
    destination_pattern=r"^(transformer\.word_embeddings\.weight|transformer\.(word_embeddings_layernorm|ln_f)\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(input_layernorm|post_attention_layernorm|self_attention\.query_key_value"
                        r"|self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.(weight|bias)|lm_head\.weight)$",
    hf_config=_bloom_hf,
))


# ---- RW (RefinedWeb) -> FalconForCausalLM ----------------------------------------------------

def _rw_problems(c: dict) -> List[str]:
    p = []
    if c.get("new_decoder_architecture"):
        p.append("new_decoder_architecture=True (PaddleNLP's RW implements only the original Falcon-7B block: "
                 "no ln_attn/ln_mlp, no grouped kv heads; the weights are not a new-architecture Falcon)")
    return p


def _rw_hf(c: dict) -> dict:
    _refuse("RWForCausalLM", _rw_problems(c))
    hidden = c["hidden_size"]
    heads = c["n_head"]
    mq = bool(c.get("multi_query", False))
    out = {
        "vocab_size": c["vocab_size"],
        "hidden_size": hidden,
        "num_hidden_layers": c["n_layer"],
        "num_attention_heads": heads,
        # PaddleNLP's Attention uses n_head kv heads, or 1 with multi_query; n_head_kv is not read
        "num_kv_heads": 1 if mq else heads,
        "new_decoder_architecture": False,
        "multi_query": mq,
        "parallel_attn": bool(c.get("parallel_attn", False)),
        "alibi": bool(c.get("alibi", False)),
        "bias": bool(c.get("bias", False)),
        "layer_norm_epsilon": c.get("layer_norm_epsilon", 1e-5),
        "initializer_range": c.get("initializer_range", 0.02),
        "hidden_dropout": c.get("hidden_dropout", 0.0),
        "attention_dropout": c.get("attention_dropout", 0.0),
        "ffn_hidden_size": 4 * hidden,
        "activation": "gelu",  # nn.GELU() (exact)
        # rotary computed for any length by Paddle (base 10000); HF needs a table bound
        "max_position_embeddings": c.get("max_position_embeddings", 2048),
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_cache": True,
    }
    out.update(_pick(c, _IDS))
    return out


def _rw(ctx: MappingContext) -> list:
    _refuse("RWForCausalLM", _rw_problems(ctx.config))
    t = "transformer"
    out = [rename(f"{t}.word_embeddings.weight", f"{t}.word_embeddings.weight")]
    out += _norm(ctx, f"{t}.ln_f", f"{t}.ln_f")
    for i in _layers(ctx, f"{t}.h."):
        s = f"{t}.h.{i}"
        out += _norm(ctx, f"{s}.input_layernorm", f"{s}.input_layernorm")
        if ctx.has(f"{s}.post_attention_layernorm.weight"):  # absent with parallel_attn
            out += _norm(ctx, f"{s}.post_attention_layernorm", f"{s}.post_attention_layernorm")
        # query_key_value: [heads, (q|k|v), head_dim], or [q heads..., k, v] with multi_query: as in HF
        for lin in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            out += _weight_bias(ctx, f"{s}.{lin}", f"{s}.{lin}", True)
    # CausalLMHead computes x @ weight.T: its weight is already [vocab, hidden]
    out += _head(ctx, "lm_head.weight")
    return out


RW = register(Preset(
    name="rw_paddlenlp",
    description="PaddleNLP 2.8 RW / RefinedWeb (Falcon-7B style) -> HF FalconForCausalLM",
    framework=_FW,
    classes=("RWForCausalLM",),
    hf_architecture="FalconForCausalLM",
    hf_model_type="falcon",
    statements=_rw,
    destination_pattern=r"^(transformer\.word_embeddings\.weight|transformer\.ln_f\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(input_layernorm|post_attention_layernorm|self_attention\.query_key_value"
                        r"|self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.(weight|bias)|lm_head\.weight)$",
    hf_config=_rw_hf,
))


