"""PaddleNLP 2.8 ChatGLMv2 and QWen -> the Hugging Face architectures that compute the same.

* ``chatglm2_paddlenlp``: PaddleNLP ``ChatGLMv2ForCausalLM`` (ChatGLM2/3) -> HF ``GlmForCausalLM``.
* ``qwen_paddlenlp``: PaddleNLP ``QWenForCausalLM`` (Qwen-1) -> HF ``Qwen2ForCausalLM``.

PaddleNLP's ChatGLM (v1, 2-D positions, GeLU, LayerNorm, alpha-scaled residuals) and GLM
(GLMForConditionalGeneration, blank infilling with block positions) have no native transformers
5.x class (its ``glm`` is GLM-4, which ChatGLMv2 maps to): no preset.

Both store Linear weights as ``[in, out]`` (a transpose each) and have fused q/k/v tensors; what
the Hugging Face class cannot express is refused, naming the config key.
"""
from __future__ import annotations

import logging

from ._paddlenlp_common import paddlenlp_preset
from .base import MappingContext
from .builders import AS_IS, DROP, LINEAR, QKV, From, Fused, layers, lm_head, refuse, table, translate

logger = logging.getLogger("paddle_fullparam_callbacks")


def _pattern(mlp: str) -> str:
    """The HF names of both: a Llama-like decoder with q/k/v biases, its MLP projections ``mlp``."""
    return (r"^(model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.(self_attn\.([qkv]_proj\.(weight|bias)"
            r"|o_proj\.weight)|mlp\.(" + mlp + r")_proj\.weight|(input|post_attention)_layernorm\.weight))"
            r"|lm_head\.weight)$")


# ---- ChatGLM2 / ChatGLM3 (PaddleNLP ChatGLMv2) ----------------------------------------------

_CHATGLM2 = "chatglm2_paddlenlp"


def _chatglm2_checks(ctx: MappingContext) -> None:
    c = ctx.config
    if not c.get("rmsnorm", True):
        refuse(_CHATGLM2, "rmsnorm=False (LayerNorm blocks): Hugging Face GlmForCausalLM has RMSNorm only")
    if c.get("apply_residual_connection_post_layernorm"):
        refuse(_CHATGLM2, "apply_residual_connection_post_layernorm=True: Hugging Face GlmForCausalLM adds the residual "
                          "before the norm")
    if not c.get("post_layer_norm", True):
        refuse(_CHATGLM2, "post_layer_norm=False (no final norm): Hugging Face GlmForCausalLM always applies one")
    if c.get("add_bias_linear"):
        refuse(_CHATGLM2, "add_bias_linear=True (biases on the output and MLP projections): Hugging Face GlmForCausalLM "
                          "has biases on q/k/v only")
    if c.get("use_long_sequence_strategies"):
        refuse(_CHATGLM2, "use_long_sequence_strategies=True: this preset does not translate PaddleNLP's long-sequence "
                          "strategies to a Hugging Face RoPE configuration")
    if ctx.tied:
        refuse(_CHATGLM2, "the export was asked to tie the output layer to the input embedding, but PaddleNLP 2.8's "
                          "ChatGLMv2ForCausalLM never ties them (output_layer is its own weight; the model has no "
                          "get_output_embeddings, so the config's tie_word_embeddings=True, PaddleNLP's default, is "
                          "taken at its word). Set model.config.tie_word_embeddings = False before exporting")
    heads, groups = c.get("num_attention_heads"), c.get("multi_query_group_num") or c.get("num_attention_heads")
    if heads % groups:
        refuse(_CHATGLM2, f"num_attention_heads={heads} is not a multiple of multi_query_group_num={groups}")


def _chatglm2_qkv(ctx: MappingContext, weight: str) -> list:
    """q heads, then the k groups, then the v groups, contiguous."""
    c = ctx.config
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    head_dim = c.get("kv_channels") or (hidden // heads)
    groups = c.get("multi_query_group_num") or heads
    width = (heads + 2 * groups) * head_dim
    if ctx.shapes.get(weight, (0, 0))[-1] != width:
        refuse(_CHATGLM2, f"{weight} has shape {list(ctx.shapes.get(weight, ()))}, expected [{hidden}, {width}] "
                          f"(heads={heads}, multi_query_group_num={groups}, kv_channels={head_dim})")
    return [("q", heads), ("k", groups), ("v", groups)]


_CHATGLM2_LAYER = [
    ("input_layernorm", AS_IS),
    ("post_attention_layernorm", AS_IS),
    ("self_attention.query_key_value", "self_attn.{}_proj", Fused(_chatglm2_qkv)),
    ("self_attention.dense", "self_attn.o_proj", LINEAR),
    ("mlp.dense_h_to_4h", "mlp.gate_up_proj", LINEAR),  # [gate, up] exactly like HF's gate_up_proj
    ("mlp.dense_4h_to_h", "mlp.down_proj", LINEAR),
]


def _chatglm2(ctx: MappingContext) -> list:
    """PaddleNLP ``ChatGLMv2ForCausalLM`` is the ChatGLM2/3 (and GLM-4-9B) architecture, which
    transformers has natively as ``GlmForCausalLM``: RMSNorm pre-norm blocks, fused q/k/v (q heads,
    then the k groups, then the v groups, contiguous) with an optional bias, grouped-query attention,
    RoPE on the first half of each head with interleaved pairs (HF Glm: ``partial_rotary_factor``
    0.5 and its interleaved ``rotate_half``), a swiglu MLP whose fused ``dense_h_to_4h`` is
    [gate, up] exactly like HF's ``gate_up_proj``, and an untied output layer."""
    _chatglm2_checks(ctx)
    top = [("embedding.word_embeddings", "model.embed_tokens", AS_IS),
           ("encoder.final_layernorm", "model.norm", AS_IS),
           ("rotary_pos_emb.inv_freq", DROP)]  # a buffer, recomputed from the config
    return (table(ctx, top, "chatglm_v2")
            + layers(ctx, "chatglm_v2.encoder.layers", "model.layers", _CHATGLM2_LAYER)
            + lm_head(ctx, "chatglm_v2.output_layer.weight", transpose=True))


# the last keys of both configs written in full below
_TAIL = {"attention_dropout": 0.0, "initializer_range": From("initializer_range", 0.02),
         **{k: From(k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}, "use_cache": From("use_cache", True)}

_CHATGLM2_CONFIG = {
    "vocab_size": lambda c: c.get("vocab_size", c.get("padded_vocab_size")),
    "hidden_size": From("hidden_size"),
    "intermediate_size": From("ffn_hidden_size"),
    "num_hidden_layers": From("num_hidden_layers"),
    "num_attention_heads": From("num_attention_heads"),
    "num_key_value_heads": lambda c: c.get("multi_query_group_num") or c["num_attention_heads"],
    "head_dim": lambda c: c.get("kv_channels") or c["hidden_size"] // c["num_attention_heads"],
    "hidden_act": "silu",
    "max_position_embeddings": From("max_sequence_length", 2048),
    "rms_norm_eps": From("layernorm_epsilon", 1e-5),
    "rope_theta": 10000.0,  # PaddleNLP 2.8's ChatGLMv2 has no rope_ratio: base 10000 always
    "partial_rotary_factor": 0.5,
    "attention_bias": From("add_qkv_bias", None, bool),
    **_TAIL,
}


def _chatglm2_hf_config(cfg: dict) -> dict:
    out = translate(cfg, _CHATGLM2_CONFIG)
    if "rope_ratio" in cfg and cfg["rope_ratio"] not in (None, 1, 1.0):
        logger.warning("ChatGLMv2: config key rope_ratio=%r is ignored by PaddleNLP 2.8 (RoPE base 10000); the snapshot "
                       "describes what the model computes", cfg["rope_ratio"])
    return out


CHATGLM2 = paddlenlp_preset(
    _CHATGLM2, "ChatGLMv2ForCausalLM", _chatglm2, _chatglm2_hf_config,
    description="PaddleNLP 2.8 ChatGLMv2 (ChatGLM2/3 architecture) -> HF GlmForCausalLM",
    hf_architecture="GlmForCausalLM",
    hf_model_type="glm",
    destination_pattern=_pattern("gate_up|down"),
)


# ---- Qwen (v1) ------------------------------------------------------------------------------

_QWEN = "qwen_paddlenlp"


def _qwen_checks(ctx: MappingContext) -> None:
    c = ctx.config
    if float(c.get("rotary_pct", 1.0)) != 1.0:
        refuse(_QWEN, f"rotary_pct={c.get('rotary_pct')} (partial RoPE): Hugging Face Qwen2ForCausalLM rotates whole heads")
    if not c.get("no_bias", True):
        refuse(_QWEN, "no_bias=False (biases on the output and MLP projections): Hugging Face Qwen2ForCausalLM has "
                      "biases on q/k/v only")
    if c.get("use_long_sequence_strategies"):
        refuse(_QWEN, "use_long_sequence_strategies=True: this preset does not translate PaddleNLP's long-sequence "
                      "strategies to a Hugging Face RoPE configuration")
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    if c.get("kv_channels") and c["kv_channels"] * heads != hidden:
        refuse(_QWEN, f"kv_channels*num_attention_heads = {c['kv_channels'] * heads} != hidden_size={hidden}")


_QWEN_LAYER = [
    ("ln_1", "input_layernorm", AS_IS),
    ("ln_2", "post_attention_layernorm", AS_IS),
    ("attn.c_attn", "self_attn.{}_proj", Fused(QKV)),  # with its bias
    ("attn.c_proj", "self_attn.o_proj", LINEAR),
    ("mlp.w2", "mlp.gate_proj", LINEAR),  # w1(x) * silu(w2(x))
    ("mlp.w1", "mlp.up_proj", LINEAR),
    ("mlp.c_proj", "mlp.down_proj", LINEAR),
]


def _qwen(ctx: MappingContext) -> list:
    """PaddleNLP ``QWenForCausalLM`` (Qwen-1) computes what transformers' native
    ``Qwen2ForCausalLM`` computes, up to its trained ``seq_length``: RMSNorm pre-norm, q/k/v with
    bias (``c_attn``: q, k, v contiguous, equal thirds), an unbiased output projection, full
    rotate-half RoPE, and a swiglu MLP whose gate is ``w2`` and up is ``w1`` (``w1(x) * silu(w2(x))``).
    Beyond ``seq_length`` Qwen-1's dynamic NTK and log-n attention scaling (``use_dynamic_ntk``,
    ``use_logn_attn``) change the numbers and Qwen2 has neither: the snapshot's
    ``max_position_embeddings`` is ``seq_length``."""
    _qwen_checks(ctx)
    return (table(ctx, [("wte", "embed_tokens", AS_IS), ("ln_f", "norm", AS_IS)], "qwen", "model")
            + layers(ctx, "qwen.h", "model.layers", _QWEN_LAYER)
            + lm_head(ctx, transpose=True))


def _qwen_seq(c: dict) -> int:
    return c.get("seq_length") or c.get("max_position_embeddings", 8192)


_QWEN_CONFIG = {
    "vocab_size": From("vocab_size"),
    "hidden_size": From("hidden_size"),
    "intermediate_size": lambda c: c["intermediate_size"] // 2,  # Qwen-1 counts w1 and w2 together
    "num_hidden_layers": From("num_hidden_layers"),
    "num_attention_heads": From("num_attention_heads"),
    "num_key_value_heads": From("num_attention_heads"),
    "hidden_act": "silu",
    "max_position_embeddings": _qwen_seq,
    "rms_norm_eps": From("layer_norm_epsilon", 1e-6),
    "rope_theta": From("rotary_emb_base", 10000, float),
    "use_sliding_window": False,
    **_TAIL,
}


def _qwen_hf_config(cfg: dict) -> dict:
    if cfg.get("use_dynamic_ntk", True) or cfg.get("use_logn_attn", True):
        seq = _qwen_seq(cfg)
        logger.warning("Qwen: use_dynamic_ntk/use_logn_attn change Qwen-1's logits beyond seq_length=%s; Hugging Face "
                       "Qwen2ForCausalLM has neither, so the snapshot says max_position_embeddings=%s", seq, seq)
    return translate(cfg, _QWEN_CONFIG)


QWEN = paddlenlp_preset(
    _QWEN, "QWenForCausalLM", _qwen, _qwen_hf_config,
    description="PaddleNLP 2.8 QWen (Qwen-1) -> HF Qwen2ForCausalLM (same numbers up to seq_length)",
    hf_architecture="Qwen2ForCausalLM",
    hf_model_type="qwen2",
    destination_pattern=_pattern("gate|up|down"),
)
