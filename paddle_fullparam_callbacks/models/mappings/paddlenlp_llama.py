"""PaddleNLP 2.8 Llama-like families -> Hugging Face.

* ``llama_paddlenlp``: PaddleNLP ``LlamaForCausalLM`` -> HF ``LlamaForCausalLM``, unfused or with
  ``fuse_attention_qkv`` and/or ``fuse_attention_ffn`` (decided per layer from the source names).
* ``mixtral_paddlenlp``: PaddleNLP ``MixtralForCausalLM`` -> HF ``MixtralForCausalLM``.
* ``chatglm2_paddlenlp``: PaddleNLP ``ChatGLMv2ForCausalLM`` (ChatGLM2/3) -> HF ``GlmForCausalLM``.
* ``qwen_paddlenlp``: PaddleNLP ``QWenForCausalLM`` (Qwen-1) -> HF ``Qwen2ForCausalLM``.

PaddleNLP's ChatGLM (v1, 2-D positions, GeLU, LayerNorm, alpha-scaled residuals) and GLM
(GLMForConditionalGeneration, blank infilling with block positions) have no native transformers
5.x class (its ``glm`` is GLM-4, which ChatGLMv2 maps to): no preset.

PaddleNLP names its tensors ``llama.layers.N...`` / ``mixtral.layers.N...`` and stores Linear
weights (and its own LM head) as ``[in, out]``: each needs a rename and a transpose.

Fused layouts (PaddleNLP 2.8.1 ``llama/modeling.py``, single process):

* ``qkv_proj.weight`` ``[hidden, (heads + 2 * kv_heads) * head_dim]``: the forward reshapes the
  output to ``[kv_heads, (groups + 2) * head_dim]`` and splits each row as ``[groups * head_dim,
  head_dim, head_dim]``, so the output columns are, per key-value group, that group's ``groups``
  query heads, then its key head, then its value head (``groups = heads // kv_heads``; with
  ``kv_heads == heads`` it is q, k, v per head). The query heads of group g are heads
  ``g * groups ... g * groups + groups - 1`` (``repeat_kv`` repeats each kv head ``groups`` times
  consecutively, as HF does).
* ``gate_up_fused_proj.weight`` ``[hidden, 2 * intermediate]``: ``swiglu(x)`` chunks the output
  in two halves, ``silu(first) * second``: gate then up.

What HF Llama cannot express is refused (``alibi``, the long-sequence strategies, unknown RoPE
scaling); the RoPE scalings PaddleNLP has are translated (``linear`` and ``dynamic_ntk`` to HF's
``linear`` / ``dynamic``, static ``ntk`` to an equivalent ``rope_theta``).
"""
from __future__ import annotations

import logging
import re
from typing import List

from ...config.schema import ConfigError
from .base import LAYER, MappingContext, Preset, drop, linear, register, rename, split_equal, split_heads

logger = logging.getLogger("paddle_fullparam_callbacks")

EXPERT = "$EXPERT_ID"  # AOAEngine expands it like $LAYER_ID


def _layers(ctx: MappingContext, prefix: str) -> List[int]:
    """The layer indices present under ``prefix`` (e.g. ``llama.layers``: ``llama.layers.N.*``)."""
    rx = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in ctx.shapes for m in [rx.match(k)] if m})


def _refuse(preset: str, why: str):
    raise ConfigError("export.aoa", f"preset {preset!r}: {why}")


# ---- Llama ----------------------------------------------------------------------------------

_LLAMA_ROPE_TYPES = (None, "linear", "ntk", "dynamic_ntk")


def _llama_forward_checks(ctx: MappingContext, preset: str) -> None:
    """Refuse configs whose PaddleNLP forward HF LlamaForCausalLM cannot reproduce."""
    if ctx.config.get("alibi"):
        _refuse(preset, "the model uses ALiBi attention biases (alibi=True) instead of RoPE; Hugging Face "
                        "LlamaForCausalLM has no ALiBi, so the snapshot would compute different logits")
    if ctx.config.get("use_long_sequence_strategies"):
        _refuse(preset, "the model uses PaddleNLP's long-sequence strategies (use_long_sequence_strategies=True, "
                        f"{ctx.config.get('long_sequence_strategy_type')}/{ctx.config.get('long_sequence_strategy_name')}); "
                        "this preset does not translate them to a Hugging Face RoPE configuration")
    kind = ctx.config.get("rope_scaling_type")
    if kind not in _LLAMA_ROPE_TYPES:
        _refuse(preset, f"unknown rope_scaling_type {kind!r} (PaddleNLP 2.8 Llama knows {_LLAMA_ROPE_TYPES[1:]})")
    if kind is not None and float(ctx.get("rope_scaling_factor", 1.0)) <= 0:
        _refuse(preset, f"rope_scaling_factor must be positive, got {ctx.config.get('rope_scaling_factor')!r}")


def _head_dims(ctx: MappingContext, preset: str, qkv_key: str):
    hidden = ctx.config.get("hidden_size")
    heads = ctx.config.get("num_attention_heads")
    if not hidden or not heads:
        _refuse(preset, f"the model config lacks hidden_size/num_attention_heads, needed to split {qkv_key}")
    kv = ctx.config.get("num_key_value_heads") or heads
    head_dim = hidden // heads  # PaddleNLP 2.8 Llama has no head_dim setting
    if heads % kv:
        _refuse(preset, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    width = (heads + 2 * kv) * head_dim
    shape = ctx.shapes[qkv_key]
    if len(shape) != 2 or shape[1] != width:
        _refuse(preset, f"{qkv_key} has shape {list(shape)}, expected [{hidden}, {width}] for heads={heads}, "
                        f"num_key_value_heads={kv}, head_dim={head_dim} (is the config the model's own?)")
    return heads, kv, head_dim


def _llama_fused_qkv(ctx: MappingContext, src: str, dst: str, preset: str) -> List[str]:
    heads, kv, _ = _head_dims(ctx, preset, src)
    groups = heads // kv
    tmp = f"__tmp__.{src}"
    out = [linear(src, f"{tmp}.T")]  # [out, in]: heads along axis 0
    out += split_heads(f"{tmp}.T", f"{tmp}.h", [("q", groups), ("k", 1), ("v", 1)] * kv, axis=0,
                       outputs={"q": f"{dst}.q_proj.weight", "k": f"{dst}.k_proj.weight", "v": f"{dst}.v_proj.weight"})
    return out


def _tensor_parallel_degree(ctx: MappingContext) -> int:
    """The tensor-parallel degree the model was built with (PaddleNLP's ``tensor_parallel_degree``)."""
    return int(ctx.parallel.get("tensor_parallel_degree") or 1)


def _llama_fused_ffn(ctx: MappingContext, src: str, dst: str, preset: str) -> List[str]:
    """Under tensor parallelism each rank's ColumnParallelLinear slice is itself [gate_r, up_r] (its
    forward chunks its own output; PaddleNLP's checkpoint merge uses ``is_naive_2fuse``), so the
    global tensor, the ranks' slices side by side, is [gate_0, up_0, gate_1, up_1, ...]."""
    tp = _tensor_parallel_degree(ctx)
    tmp = f"__tmp__.{src}"
    gate, up = f"{dst}.gate_proj.weight", f"{dst}.up_proj.weight"
    if tp <= 1:
        return [linear(src, f"{tmp}.T"), split_equal(f"{tmp}.T", [gate, up], axis=0)]
    width = ctx.shapes[src][1]
    if width % (2 * tp):
        _refuse(preset, f"{src} has {width} output columns, not divisible into gate/up for tensor_parallel_degree={tp}")
    return [linear(src, f"{tmp}.T")] + split_heads(f"{tmp}.T", f"{tmp}.p", [("gate", 1), ("up", 1)] * tp, axis=0,
                                                    outputs={"gate": gate, "up": up})


def _llama(ctx: MappingContext) -> list:
    name, p, L = "llama_paddlenlp", "llama", LAYER
    _llama_forward_checks(ctx, name)
    out = [
        rename(f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
        rename(f"{p}.norm.weight", "model.norm.weight"),
    ]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(rename(f"{p}.layers.{L}.{norm}.weight", f"model.layers.{L}.{norm}.weight"))
    out.append(linear(f"{p}.layers.{L}.self_attn.o_proj.weight", f"model.layers.{L}.self_attn.o_proj.weight"))
    out.append(linear(f"{p}.layers.{L}.mlp.down_proj.weight", f"model.layers.{L}.mlp.down_proj.weight"))
    # fused or not is a config-wide switch, but decide per layer from the names: a stray layout
    # then still maps (or is caught by destination_pattern) instead of silently half-mapping
    for i in _layers(ctx, f"{p}.layers"):
        src, dst = f"{p}.layers.{i}.self_attn", f"model.layers.{i}.self_attn"
        if ctx.has(f"{src}.qkv_proj.weight"):
            out += _llama_fused_qkv(ctx, f"{src}.qkv_proj.weight", dst, name)
        else:
            out += [linear(f"{src}.{x}_proj.weight", f"{dst}.{x}_proj.weight") for x in "qkv" if ctx.has(f"{src}.{x}_proj.weight")]
        src, dst = f"{p}.layers.{i}.mlp", f"model.layers.{i}.mlp"
        if ctx.has(f"{src}.gate_up_fused_proj.weight"):
            out += _llama_fused_ffn(ctx, f"{src}.gate_up_fused_proj.weight", dst, name)
        else:
            out += [linear(f"{src}.{x}_proj.weight", f"{dst}.{x}_proj.weight") for x in ("gate", "up") if ctx.has(f"{src}.{x}_proj.weight")]
    if ctx.has("lm_head.weight"):
        out.append(drop("lm_head.weight") if ctx.tied else linear("lm_head.weight", "lm_head.weight"))
    return out


# PaddleNLP training / kernel / parallelism switches: no effect on the forward's numbers on one
# process, unknown to transformers, and a reload should take PaddleNLP's defaults
_PADDLENLP_RUNTIME_KEYS = (
    "seq_length", "use_recompute", "recompute_granularity", "no_recompute_layers", "pp_recompute_interval",
    "recompute_use_reentrant", "use_flash_attention", "use_fused_rms_norm", "fuse_rms_norm", "use_fused_rope",
    "sequence_parallel", "fuse_sequence_parallel_allreduce", "virtual_pp_degree", "tensor_parallel_output",
    "use_fused_linear", "fuse_attention_qkv", "fuse_attention_ffn", "alibi", "rope_scaling_factor", "rope_scaling_type",
    "long_sequence_strategy_type", "long_sequence_strategy_name", "long_sequence_init_args",
    "use_long_sequence_strategies", "quantization_config", "dtype", "paddlenlp_version", "rope_fusion_level",
)
# keys some configs carry (e.g. copied from a Hugging Face config.json) that PaddleNLP 2.8's
# Llama/Mixtral forward ignores: written by the preset from what PaddleNLP really computes
_IGNORED_BY_PADDLENLP = ("rope_scaling", "rope_parameters", "rope_type", "partial_rotary_factor", "pretraining_tp",
                         "head_dim", "attention_bias", "mlp_bias", "hidden_act", "sliding_window", "max_window_layers",
                         "use_sliding_window")


def _common_hf(cfg: dict, forced: dict, family: str) -> dict:
    out = {k: v for k, v in cfg.items() if k not in _PADDLENLP_RUNTIME_KEYS and k not in _IGNORED_BY_PADDLENLP}
    for key in _IGNORED_BY_PADDLENLP:
        if key in cfg and key not in forced and cfg[key] not in (None, False, 0, 1, "default", {}):
            logger.warning("%s: config key %s=%r is ignored by PaddleNLP 2.8's %s; the snapshot describes what the "
                           "model computes (key dropped)", family, key, cfg[key], family)
        elif key in forced and key in cfg and cfg[key] != forced[key]:
            logger.warning("%s: config says %s=%r but PaddleNLP 2.8's %s computes with %r; the snapshot says %r",
                           family, key, cfg[key], family, forced[key], forced[key])
    out.update(forced)
    return out


def _llama_hf_config(cfg: dict) -> dict:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    forced = {
        "hidden_act": "silu",  # LlamaMLP is swiglu (silu) whatever hidden_act says
        "head_dim": head_dim,
        "attention_bias": False,
        "mlp_bias": False,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "rope_theta": float(cfg.get("rope_theta", 10000.0)),
    }
    kind, factor = cfg.get("rope_scaling_type"), float(cfg.get("rope_scaling_factor") or 1.0)
    if kind == "linear":
        forced["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind == "dynamic_ntk":
        forced["rope_scaling"] = {"rope_type": "dynamic", "factor": factor}
    elif kind == "ntk":  # static NTK: a larger base, nothing else
        forced["rope_theta"] = forced["rope_theta"] * factor ** (head_dim / (head_dim - 2))
    if kind in ("linear", "dynamic_ntk"):
        # PaddleNLP's own keys too, so that a PaddleNLP reload (which ignores rope_scaling) scales the same;
        # transformers ignores them. Static NTK is fully in rope_theta: its keys go (a reload would scale twice)
        forced.update(rope_scaling_type=kind, rope_scaling_factor=factor)
    out = _common_hf(cfg, forced, "Llama")
    out.setdefault("rms_norm_eps", 1e-6)
    return out


LLAMA = register(Preset(
    name="llama_paddlenlp",
    description="PaddleNLP 2.8 Llama (llama.* names, [in, out] Linear; q/k/v and gate/up fused or not) "
                "-> HF LlamaForCausalLM",
    framework="paddlenlp",
    classes=("LlamaForCausalLM",),
    hf_architecture="LlamaForCausalLM",
    hf_model_type="llama",
    statements=_llama,
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                        r"|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
    hf_config=_llama_hf_config,
))


# ---- Mixtral --------------------------------------------------------------------------------

def _mixtral(ctx: MappingContext) -> list:
    """Per-expert names, as transformers' own ``save_pretrained`` writes Mixtral (5.x too: its
    in-memory ``mlp.experts.gate_up_proj`` / ``down_proj`` are fused on load by its conversion
    mapping and split back on save), which every Mixtral reader (transformers 4.x/5.x, vLLM,
    llama.cpp converters) understands."""
    p, L, E = "mixtral", LAYER, EXPERT
    out = [
        rename(f"{p}.embed_tokens.weight", "model.embed_tokens.weight"),
        rename(f"{p}.norm.weight", "model.norm.weight"),
    ]
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(rename(f"{p}.layers.{L}.{norm}.weight", f"model.layers.{L}.{norm}.weight"))
    for x in "qkvo":
        out.append(linear(f"{p}.layers.{L}.self_attn.{x}_proj.weight", f"model.layers.{L}.self_attn.{x}_proj.weight"))
    moe = "block_sparse_moe"
    out.append(linear(f"{p}.layers.{L}.{moe}.gate.weight", f"model.layers.{L}.{moe}.gate.weight"))
    for w in ("w1", "w2", "w3"):
        out.append(linear(f"{p}.layers.{L}.{moe}.experts.{E}.{w}.weight", f"model.layers.{L}.{moe}.experts.{E}.{w}.weight"))
    if ctx.has("lm_head.weight"):
        out.append(drop("lm_head.weight") if ctx.tied else linear("lm_head.weight", "lm_head.weight"))
    return out


def _mixtral_hf_config(cfg: dict) -> dict:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    forced = {
        "hidden_act": cfg.get("hidden_act") or "silu",  # MixtralMLP does use ACT2FN[hidden_act]
        "head_dim": hidden // heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "rope_theta": float(cfg.get("rope_theta", 1e6)),
        "sliding_window": None,  # PaddleNLP 2.8 Mixtral warns "We do not support sliding window" and attends fully
        "router_jitter_noise": 0.0,
    }
    return _common_hf({k: v for k, v in cfg.items() if k != "hidden_act"}, forced, "Mixtral")


MIXTRAL = register(Preset(
    name="mixtral_paddlenlp",
    description="PaddleNLP 2.8 Mixtral (mixtral.* names, [in, out] Linear, per-expert w1/w2/w3) -> HF MixtralForCausalLM",
    framework="paddlenlp",
    classes=("MixtralForCausalLM",),
    hf_architecture="MixtralForCausalLM",
    hf_model_type="mixtral",
    statements=_mixtral,
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.(gate"
                        r"|experts\.\d+\.w[123])|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
    hf_config=_mixtral_hf_config,
))


# ---- ChatGLM2 / ChatGLM3 (PaddleNLP ChatGLMv2) ----------------------------------------------

def _chatglm2(ctx: MappingContext) -> list:
    """PaddleNLP ``ChatGLMv2ForCausalLM`` is the ChatGLM2/3 (and GLM-4-9B) architecture, which
    transformers has natively as ``GlmForCausalLM``: RMSNorm pre-norm blocks, fused q/k/v (q heads,
    then the k groups, then the v groups, contiguous) with an optional bias, grouped-query attention,
    RoPE on the first half of each head with interleaved pairs (HF Glm: ``partial_rotary_factor``
    0.5 and its interleaved ``rotate_half``), a swiglu MLP whose fused ``dense_h_to_4h`` is
    [gate, up] exactly like HF's ``gate_up_proj``, and an untied output layer."""
    name, p = "chatglm2_paddlenlp", "chatglm_v2"
    c = ctx.config
    if not c.get("rmsnorm", True):
        _refuse(name, "rmsnorm=False (LayerNorm blocks): Hugging Face GlmForCausalLM has RMSNorm only")
    if c.get("apply_residual_connection_post_layernorm"):
        _refuse(name, "apply_residual_connection_post_layernorm=True: Hugging Face GlmForCausalLM adds the residual before the norm")
    if not c.get("post_layer_norm", True):
        _refuse(name, "post_layer_norm=False (no final norm): Hugging Face GlmForCausalLM always applies one")
    if c.get("add_bias_linear"):
        _refuse(name, "add_bias_linear=True (biases on the output and MLP projections): Hugging Face GlmForCausalLM has "
                      "biases on q/k/v only")
    if c.get("use_long_sequence_strategies"):
        _refuse(name, "use_long_sequence_strategies=True: this preset does not translate PaddleNLP's long-sequence "
                      "strategies to a Hugging Face RoPE configuration")
    if ctx.tied:
        _refuse(name, "the export was asked to tie the output layer to the input embedding, but PaddleNLP 2.8's "
                      "ChatGLMv2ForCausalLM never ties them (output_layer is its own weight; the model has no "
                      "get_output_embeddings, so the config's tie_word_embeddings=True, PaddleNLP's default, is taken "
                      "at its word). Set model.config.tie_word_embeddings = False before exporting")
    heads = c.get("num_attention_heads")
    hidden = c.get("hidden_size")
    head_dim = c.get("kv_channels") or (hidden // heads)
    groups = c.get("multi_query_group_num") or heads
    if heads % groups:
        _refuse(name, f"num_attention_heads={heads} is not a multiple of multi_query_group_num={groups}")
    layout = [("q", heads), ("k", groups), ("v", groups)]
    out = [
        rename(f"{p}.embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        rename(f"{p}.encoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if ctx.has(f"{p}.rotary_pos_emb.inv_freq"):
        out.append(drop(f"{p}.rotary_pos_emb.inv_freq"))  # a buffer, recomputed from the config
    for i in _layers(ctx, f"{p}.encoder.layers"):
        s, d = f"{p}.encoder.layers.{i}", f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(rename(f"{s}.{norm}.weight", f"{d}.{norm}.weight"))
        qkv = f"{s}.self_attention.query_key_value"
        width = (heads + 2 * groups) * head_dim
        if ctx.shapes.get(f"{qkv}.weight", (0, 0))[-1] != width:
            _refuse(name, f"{qkv}.weight has shape {list(ctx.shapes.get(qkv + '.weight', ()))}, expected "
                          f"[{hidden}, {width}] (heads={heads}, multi_query_group_num={groups}, kv_channels={head_dim})")
        tmp = f"__tmp__.{qkv}"
        out.append(linear(f"{qkv}.weight", f"{tmp}.T"))
        out += split_heads(f"{tmp}.T", f"{tmp}.w", layout, axis=0,
                           outputs={x: f"{d}.self_attn.{x}_proj.weight" for x in "qkv"})
        if ctx.has(f"{qkv}.bias"):
            out += split_heads(f"{qkv}.bias", f"{tmp}.b", layout, axis=0,
                               outputs={x: f"{d}.self_attn.{x}_proj.bias" for x in "qkv"})
        out.append(linear(f"{s}.self_attention.dense.weight", f"{d}.self_attn.o_proj.weight"))
        out.append(linear(f"{s}.mlp.dense_h_to_4h.weight", f"{d}.mlp.gate_up_proj.weight"))
        out.append(linear(f"{s}.mlp.dense_4h_to_h.weight", f"{d}.mlp.down_proj.weight"))
    if ctx.has(f"{p}.output_layer.weight"):
        out.append(linear(f"{p}.output_layer.weight", "lm_head.weight"))
    return out


def _chatglm2_hf_config(cfg: dict) -> dict:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    out = {
        "vocab_size": cfg.get("vocab_size", cfg.get("padded_vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("multi_query_group_num") or heads,
        "head_dim": cfg.get("kv_channels") or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.get("max_sequence_length", 2048),
        "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5),
        "rope_theta": 10000.0,  # PaddleNLP 2.8's ChatGLMv2 has no rope_ratio: base 10000 always
        "partial_rotary_factor": 0.5,
        "attention_bias": bool(cfg.get("add_qkv_bias")),
        "attention_dropout": 0.0,
        "initializer_range": cfg.get("initializer_range", 0.02),
        "pad_token_id": cfg.get("pad_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "use_cache": cfg.get("use_cache", True),
    }
    if "rope_ratio" in cfg and cfg["rope_ratio"] not in (None, 1, 1.0):
        logger.warning("ChatGLMv2: config key rope_ratio=%r is ignored by PaddleNLP 2.8 (RoPE base 10000); the snapshot "
                       "describes what the model computes", cfg["rope_ratio"])
    return out


CHATGLM2 = register(Preset(
    name="chatglm2_paddlenlp",
    description="PaddleNLP 2.8 ChatGLMv2 (ChatGLM2/3 architecture) -> HF GlmForCausalLM",
    framework="paddlenlp",
    classes=("ChatGLMv2ForCausalLM",),
    hf_architecture="GlmForCausalLM",
    hf_model_type="glm",
    statements=_chatglm2,
    destination_pattern=r"^(model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.(self_attn\.([qkv]_proj\.(weight|bias)"
                        r"|o_proj\.weight)|mlp\.(gate_up|down)_proj\.weight|(input|post_attention)_layernorm\.weight))"
                        r"|lm_head\.weight)$",
    hf_config=_chatglm2_hf_config,
))


# ---- Qwen (v1) ------------------------------------------------------------------------------

def _qwen(ctx: MappingContext) -> list:
    """PaddleNLP ``QWenForCausalLM`` (Qwen-1) computes what transformers' native
    ``Qwen2ForCausalLM`` computes, up to its trained ``seq_length``: RMSNorm pre-norm, q/k/v with
    bias (``c_attn``: q, k, v contiguous, equal thirds), an unbiased output projection, full
    rotate-half RoPE, and a swiglu MLP whose gate is ``w2`` and up is ``w1`` (``w1(x) * silu(w2(x))``).
    Beyond ``seq_length`` Qwen-1's dynamic NTK and log-n attention scaling (``use_dynamic_ntk``,
    ``use_logn_attn``) change the numbers and Qwen2 has neither: the snapshot's
    ``max_position_embeddings`` is ``seq_length``."""
    name, p = "qwen_paddlenlp", "qwen"
    c = ctx.config
    if float(c.get("rotary_pct", 1.0)) != 1.0:
        _refuse(name, f"rotary_pct={c.get('rotary_pct')} (partial RoPE): Hugging Face Qwen2ForCausalLM rotates whole heads")
    if not c.get("no_bias", True):
        _refuse(name, "no_bias=False (biases on the output and MLP projections): Hugging Face Qwen2ForCausalLM has "
                      "biases on q/k/v only")
    if c.get("use_long_sequence_strategies"):
        _refuse(name, "use_long_sequence_strategies=True: this preset does not translate PaddleNLP's long-sequence "
                      "strategies to a Hugging Face RoPE configuration")
    heads, hidden = c.get("num_attention_heads"), c.get("hidden_size")
    if c.get("kv_channels") and c["kv_channels"] * heads != hidden:
        _refuse(name, f"kv_channels*num_attention_heads = {c['kv_channels'] * heads} != hidden_size={hidden}")
    out = [
        rename(f"{p}.wte.weight", "model.embed_tokens.weight"),
        rename(f"{p}.ln_f.weight", "model.norm.weight"),
    ]
    for i in _layers(ctx, f"{p}.h"):
        s, d = f"{p}.h.{i}", f"model.layers.{i}"
        out.append(rename(f"{s}.ln_1.weight", f"{d}.input_layernorm.weight"))
        out.append(rename(f"{s}.ln_2.weight", f"{d}.post_attention_layernorm.weight"))
        tmp = f"__tmp__.{s}.attn.c_attn"
        out.append(linear(f"{s}.attn.c_attn.weight", f"{tmp}.T"))
        out.append(split_equal(f"{tmp}.T", [f"{d}.self_attn.{x}_proj.weight" for x in "qkv"], axis=0))
        if ctx.has(f"{s}.attn.c_attn.bias"):
            out.append(split_equal(f"{s}.attn.c_attn.bias", [f"{d}.self_attn.{x}_proj.bias" for x in "qkv"], axis=0))
        out.append(linear(f"{s}.attn.c_proj.weight", f"{d}.self_attn.o_proj.weight"))
        out.append(linear(f"{s}.mlp.w2.weight", f"{d}.mlp.gate_proj.weight"))
        out.append(linear(f"{s}.mlp.w1.weight", f"{d}.mlp.up_proj.weight"))
        out.append(linear(f"{s}.mlp.c_proj.weight", f"{d}.mlp.down_proj.weight"))
    if ctx.has("lm_head.weight"):
        out.append(drop("lm_head.weight") if ctx.tied else linear("lm_head.weight", "lm_head.weight"))
    return out


def _qwen_hf_config(cfg: dict) -> dict:
    heads = cfg["num_attention_heads"]
    seq = cfg.get("seq_length") or cfg.get("max_position_embeddings", 8192)
    if cfg.get("use_dynamic_ntk", True) or cfg.get("use_logn_attn", True):
        logger.warning("Qwen: use_dynamic_ntk/use_logn_attn change Qwen-1's logits beyond seq_length=%s; Hugging Face "
                       "Qwen2ForCausalLM has neither, so the snapshot says max_position_embeddings=%s", seq, seq)
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"] // 2,  # Qwen-1 counts w1 and w2 together
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "hidden_act": "silu",
        "max_position_embeddings": seq,
        "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-6),
        "rope_theta": float(cfg.get("rotary_emb_base", 10000)),
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.get("initializer_range", 0.02),
        "pad_token_id": cfg.get("pad_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "use_cache": cfg.get("use_cache", True),
    }


QWEN = register(Preset(
    name="qwen_paddlenlp",
    description="PaddleNLP 2.8 QWen (Qwen-1) -> HF Qwen2ForCausalLM (same numbers up to seq_length)",
    framework="paddlenlp",
    classes=("QWenForCausalLM",),
    hf_architecture="Qwen2ForCausalLM",
    hf_model_type="qwen2",
    statements=_qwen,
    destination_pattern=r"^(model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\.(self_attn\.([qkv]_proj\.(weight|bias)"
                        r"|o_proj\.weight)|mlp\.(gate|up|down)_proj\.weight|(input|post_attention)_layernorm\.weight))"
                        r"|lm_head\.weight)$",
    hf_config=_qwen_hf_config,
))
