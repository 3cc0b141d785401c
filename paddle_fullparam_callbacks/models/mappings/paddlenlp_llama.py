"""PaddleNLP 2.8 Llama and Mixtral -> Hugging Face.

* ``llama_paddlenlp``: PaddleNLP ``LlamaForCausalLM`` -> HF ``LlamaForCausalLM``, unfused or with
  ``fuse_attention_qkv`` and/or ``fuse_attention_ffn`` (decided per layer from the source names).
* ``mixtral_paddlenlp``: PaddleNLP ``MixtralForCausalLM`` -> HF ``MixtralForCausalLM``.

(ChatGLMv2 and Qwen-1, which map to other HF architectures of this shape, are in
``paddlenlp_glm_qwen.py``.)

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

from ._paddlenlp_common import paddlenlp_preset
from .base import MappingContext
from .builders import AS_IS, EXPERT, GATE_UP, LINEAR, From, Fused, layers, lm_head, optional, refuse, table, translate

logger = logging.getLogger("paddle_fullparam_callbacks")

def _llama_like(ctx: MappingContext, prefix: str, rows) -> list:
    """``{prefix}.embed_tokens``, ``{prefix}.norm``, ``{prefix}.layers.N`` (``rows``) -> HF ``model.*``;
    PaddleNLP's own LM head is [hidden, vocab]."""
    return (table(ctx, [("embed_tokens", AS_IS), ("norm", AS_IS)], prefix, "model")
            + layers(ctx, f"{prefix}.layers", "model.layers", rows)
            + lm_head(ctx, transpose=True))


# ---- Llama ----------------------------------------------------------------------------------

_LLAMA = "llama_paddlenlp"
_LLAMA_ROPE_TYPES = (None, "linear", "ntk", "dynamic_ntk")


def _llama_forward_checks(ctx: MappingContext) -> None:
    """Refuse configs whose PaddleNLP forward HF LlamaForCausalLM cannot reproduce."""
    if ctx.config.get("alibi"):
        refuse(_LLAMA, "the model uses ALiBi attention biases (alibi=True) instead of RoPE; Hugging Face "
                       "LlamaForCausalLM has no ALiBi, so the snapshot would compute different logits")
    if ctx.config.get("use_long_sequence_strategies"):
        refuse(_LLAMA, "the model uses PaddleNLP's long-sequence strategies (use_long_sequence_strategies=True, "
                       f"{ctx.config.get('long_sequence_strategy_type')}/{ctx.config.get('long_sequence_strategy_name')}); "
                       "this preset does not translate them to a Hugging Face RoPE configuration")
    kind = ctx.config.get("rope_scaling_type")
    if kind not in _LLAMA_ROPE_TYPES:
        refuse(_LLAMA, f"unknown rope_scaling_type {kind!r} (PaddleNLP 2.8 Llama knows {_LLAMA_ROPE_TYPES[1:]})")
    if kind is not None and float(ctx.get("rope_scaling_factor", 1.0)) <= 0:
        refuse(_LLAMA, f"rope_scaling_factor must be positive, got {ctx.config.get('rope_scaling_factor')!r}")


def _llama_qkv(ctx: MappingContext, weight: str) -> list:
    """Per key-value group: its query heads, its key head, its value head (see the module's docstring)."""
    hidden = ctx.config.get("hidden_size")
    heads = ctx.config.get("num_attention_heads")
    if not hidden or not heads:
        refuse(_LLAMA, f"the model config lacks hidden_size/num_attention_heads, needed to split {weight}")
    kv = ctx.config.get("num_key_value_heads") or heads
    head_dim = hidden // heads  # PaddleNLP 2.8 Llama has no head_dim setting
    if heads % kv:
        refuse(_LLAMA, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    width = (heads + 2 * kv) * head_dim
    shape = ctx.shapes[weight]
    if len(shape) != 2 or shape[1] != width:
        refuse(_LLAMA, f"{weight} has shape {list(shape)}, expected [{hidden}, {width}] for heads={heads}, "
                       f"num_key_value_heads={kv}, head_dim={head_dim} (is the config the model's own?)")
    return [("q", heads // kv), ("k", 1), ("v", 1)] * kv


def _llama_gate_up(ctx: MappingContext, weight: str) -> list:
    """Under tensor parallelism each rank's ColumnParallelLinear slice is itself [gate_r, up_r] (its
    forward chunks its own output; PaddleNLP's checkpoint merge uses ``is_naive_2fuse``), so the
    global tensor, the ranks' slices side by side, is [gate_0, up_0, gate_1, up_1, ...]."""
    tp = int(ctx.parallel.get("tensor_parallel_degree") or 1)  # as the model was built
    if tp <= 1:
        return GATE_UP
    width = ctx.shapes[weight][1]
    if width % (2 * tp):
        refuse(_LLAMA, f"{weight} has {width} output columns, not divisible into gate/up for tensor_parallel_degree={tp}")
    return GATE_UP * tp


_LLAMA_LAYER = [
    ("input_layernorm", AS_IS),
    ("post_attention_layernorm", AS_IS),
    ("self_attn.o_proj", LINEAR),
    ("mlp.down_proj", LINEAR),
    # fused or not is a config-wide switch, but decide per layer from the names: a stray layout
    # then still maps (or is caught by destination_pattern) instead of silently half-mapping
    ("self_attn.qkv_proj", "self_attn.{}_proj", optional(Fused(_llama_qkv))),
    *[(f"self_attn.{x}_proj", optional(LINEAR)) for x in "qkv"],
    ("mlp.gate_up_fused_proj", "mlp.{}_proj", optional(Fused(_llama_gate_up))),
    *[(f"mlp.{x}_proj", optional(LINEAR)) for x in ("gate", "up")],
]


def _llama(ctx: MappingContext) -> list:
    _llama_forward_checks(ctx)
    return _llama_like(ctx, "llama", _LLAMA_LAYER)


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
    """The model config without PaddleNLP's runtime keys and the keys its forward ignores, then
    ``forced`` (what it really computes with); each contradiction is logged."""
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


def _head_dim(c: dict) -> int:
    return c["hidden_size"] // c["num_attention_heads"]


def _kv_heads(c: dict) -> int:
    return c.get("num_key_value_heads") or c["num_attention_heads"]


_LLAMA_COMPUTES = {
    "hidden_act": "silu",  # LlamaMLP is swiglu (silu) whatever hidden_act says
    "head_dim": _head_dim,
    "attention_bias": False,
    "mlp_bias": False,
    "num_key_value_heads": _kv_heads,
    "rope_theta": From("rope_theta", 10000.0, float),
}


def _llama_hf_config(cfg: dict) -> dict:
    forced = translate(cfg, _LLAMA_COMPUTES)
    head_dim = forced["head_dim"]
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


LLAMA = paddlenlp_preset(
    _LLAMA, "LlamaForCausalLM", _llama, _llama_hf_config,
    description="PaddleNLP 2.8 Llama (llama.* names, [in, out] Linear; q/k/v and gate/up fused or not) "
                "-> HF LlamaForCausalLM",
    hf_architecture="LlamaForCausalLM",
    hf_model_type="llama",
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                        r"|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
)


# ---- Mixtral --------------------------------------------------------------------------------

# Per-expert names, as transformers' own ``save_pretrained`` writes Mixtral (5.x too: its in-memory
# ``mlp.experts.gate_up_proj`` / ``down_proj`` are fused on load by its conversion mapping and split
# back on save), which every Mixtral reader (transformers 4.x/5.x, vLLM, llama.cpp converters) understands
_MIXTRAL_LAYER = [
    ("input_layernorm", AS_IS),
    ("post_attention_layernorm", AS_IS),
    *[(f"self_attn.{x}_proj", LINEAR) for x in "qkvo"],
    ("block_sparse_moe.gate", LINEAR),
    *[(f"block_sparse_moe.experts.{EXPERT}.{w}", LINEAR) for w in ("w1", "w2", "w3")],
]


_MIXTRAL_COMPUTES = {
    "hidden_act": lambda c: c.get("hidden_act") or "silu",  # MixtralMLP does use ACT2FN[hidden_act]
    "head_dim": _head_dim,
    "num_key_value_heads": _kv_heads,
    "rope_theta": From("rope_theta", 1e6, float),
    "sliding_window": None,  # PaddleNLP 2.8 Mixtral warns "We do not support sliding window" and attends fully
    "router_jitter_noise": 0.0,
}


def _mixtral_hf_config(cfg: dict) -> dict:
    return _common_hf({k: v for k, v in cfg.items() if k != "hidden_act"}, translate(cfg, _MIXTRAL_COMPUTES), "Mixtral")


MIXTRAL = paddlenlp_preset(
    "mixtral_paddlenlp", "MixtralForCausalLM", lambda ctx: _llama_like(ctx, "mixtral", _MIXTRAL_LAYER),
    _mixtral_hf_config,
    description="PaddleNLP 2.8 Mixtral (mixtral.* names, [in, out] Linear, per-expert w1/w2/w3) -> HF MixtralForCausalLM",
    hf_architecture="MixtralForCausalLM",
    hf_model_type="mixtral",
    destination_pattern=r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.(gate"
                        r"|experts\.\d+\.w[123])|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
)
