"""PaddleNLP 2.8 Bloom and RW -> Hugging Face ``BloomForCausalLM`` and ``FalconForCausalLM``.

- ``BloomForCausalLM``: same per-head ``[q, k, v]`` fused layout in both; the LM head
  (``lm_head.decoder_weight``) is always the word embedding.
- ``RWForCausalLM`` -> ``FalconForCausalLM`` (old decoder architecture only: that is all PaddleNLP's
  RW implements; ``n_head_kv`` is ignored by it, so the kv heads are ``n_head`` or 1 (multi_query)).
"""
from __future__ import annotations

from typing import List

from ._paddlenlp_common import paddlenlp_preset
from .base import MappingContext
from .builders import AS_IS, IDS, KEEP, LINEAR, From, config_table, layers, lm_head, optional, table

# fused qkv: [heads, (q|k|v), head_dim] on the output axis in both frameworks (RW's multi_query:
# [q heads..., k, v], as in HF too); every Linear is the Paddle [in, out] one
_LINEARS = [(lin, LINEAR) for lin in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                                      "mlp.dense_4h_to_h")]


def _pattern(norms: str) -> str:
    """The HF names of both, ``norms`` (a regex) those outside the blocks."""
    return (r"^(transformer\.word_embeddings\.weight|transformer\." + norms + r"\.(weight|bias)"
            r"|transformer\.h\.\d+\.(input_layernorm|post_attention_layernorm|self_attention\.query_key_value"
            r"|self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)\.(weight|bias)|lm_head\.weight)$")


# ---- Bloom -> BloomForCausalLM ---------------------------------------------------------------

def _bloom_problems(c: dict) -> List[str]:
    p = []
    if c.get("use_long_sequence_strategies"):
        p.append("use_long_sequence_strategies=True (its alibi is not Bloom's)")
    return p


_BLOOM_KEYS = ("vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon", "initializer_range",
               "apply_residual_connection_post_layernorm", "hidden_dropout", "attention_dropout", "pretraining_tp",
               "slow_but_exact")
_BLOOM_LAYER = [("input_layernorm", AS_IS), ("post_attention_layernorm", AS_IS), *_LINEARS]


def _bloom(ctx: MappingContext) -> list:
    return (table(ctx, [("word_embeddings", AS_IS), ("word_embeddings_layernorm", AS_IS), ("ln_f", AS_IS)],
                  "bloom", "transformer")
            + layers(ctx, "bloom.h", "transformer.h", _BLOOM_LAYER)
            # BloomLMHead.decoder_weight *is* the word embedding (BloomForCausalLM passes it in). The package
            # decides "tied" from config.tie_word_embeddings here (the head has no .weight): if that says
            # False, the untied HF head gets the same values, which is still exact.
            + lm_head(ctx, "lm_head.decoder_weight"))


BLOOM = paddlenlp_preset(
    "bloom_paddlenlp", "BloomForCausalLM", _bloom,
    config_table({**{k: KEEP for k in _BLOOM_KEYS}, **IDS, "use_cache": True}), _bloom_problems,
    description="PaddleNLP 2.8 Bloom (bloom.* names, [in, out] Linear) -> HF BloomForCausalLM",
    hf_architecture="BloomForCausalLM",
    hf_model_type="bloom",
    destination_pattern=_pattern("(word_embeddings_layernorm|ln_f)"),
)


# ---- RW (RefinedWeb) -> FalconForCausalLM ----------------------------------------------------

def _rw_problems(c: dict) -> List[str]:
    p = []
    if c.get("new_decoder_architecture"):
        p.append("new_decoder_architecture=True (PaddleNLP's RW implements only the original Falcon-7B block: "
                 "no ln_attn/ln_mlp, no grouped kv heads; the weights are not a new-architecture Falcon)")
    return p


def _multi_query(c: dict) -> bool:
    return bool(c.get("multi_query", False))


_RW_CONFIG = {
    "vocab_size": From("vocab_size"),
    "hidden_size": From("hidden_size"),
    "num_hidden_layers": From("n_layer"),
    "num_attention_heads": From("n_head"),
    # PaddleNLP's Attention uses n_head kv heads, or 1 with multi_query; n_head_kv is not read
    "num_kv_heads": lambda c: 1 if _multi_query(c) else c["n_head"],
    "new_decoder_architecture": False,
    "multi_query": _multi_query,
    "parallel_attn": From("parallel_attn", False, bool),
    "alibi": From("alibi", False, bool),
    "bias": From("bias", False, bool),
    "layer_norm_epsilon": From("layer_norm_epsilon", 1e-5),
    "initializer_range": From("initializer_range", 0.02),
    "hidden_dropout": From("hidden_dropout", 0.0),
    "attention_dropout": From("attention_dropout", 0.0),
    "ffn_hidden_size": lambda c: 4 * c["hidden_size"],
    "activation": "gelu",  # nn.GELU() (exact)
    # rotary computed for any length by Paddle (base 10000); HF needs a table bound
    "max_position_embeddings": From("max_position_embeddings", 2048),
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "use_cache": True,
    **IDS,
}
_RW_LAYER = [("input_layernorm", AS_IS), ("post_attention_layernorm", optional(AS_IS)),  # absent with parallel_attn
             *_LINEARS]


def _rw(ctx: MappingContext) -> list:
    return (table(ctx, [("transformer.word_embeddings", AS_IS), ("transformer.ln_f", AS_IS)])
            + layers(ctx, "transformer.h", "transformer.h", _RW_LAYER)
            + lm_head(ctx))  # CausalLMHead computes x @ weight.T: its weight is already [vocab, hidden]


RW = paddlenlp_preset(
    "rw_paddlenlp", "RWForCausalLM", _rw, config_table(_RW_CONFIG), _rw_problems,
    description="PaddleNLP 2.8 RW / RefinedWeb (Falcon-7B style) -> HF FalconForCausalLM",
    hf_architecture="FalconForCausalLM",
    hf_model_type="falcon",
    destination_pattern=_pattern("ln_f"),
)
