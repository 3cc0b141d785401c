"""PaddleNLP 2.8 GPT-family causal LMs -> their Hugging Face architectures.

PaddleNLP 2.8.1 writes no Hugging Face format for any of these, so every layout detail below was
read from both implementations (PaddleNLP 2.8.1, transformers 5.x) and checked on tiny models:

- ``GPTForCausalLM`` (``GPTLMHeadModel`` is an alias of it) -> ``GPT2LMHeadModel``. HF GPT-2 uses
  ``Conv1D`` (``[in, out]``, like Paddle's Linear): no transposes. Separate q/k/v are concatenated
  into ``c_attn``; a fused ``qkv_proj`` is stored per head as ``[q_h, k_h, v_h]`` and regrouped.
  The LM head is always the word embedding. Paddle's GPT layer norms use eps 1e-5 whatever
  ``layer_norm_eps`` says, and its "gelu" is the tanh approximation (``gelu_new``).
- ``BloomForCausalLM`` -> ``BloomForCausalLM``: same per-head ``[q, k, v]`` fused layout in both;
  the LM head (``lm_head.decoder_weight``) is always the word embedding.
- ``RWForCausalLM`` -> ``FalconForCausalLM`` (old decoder architecture only: that is all PaddleNLP's
  RW implements; ``n_head_kv`` is ignored by it, so the kv heads are ``n_head`` or 1 (multi_query)).
- ``OPTForCausalLM`` -> ``OPTForCausalLM``: the learned positions carry the same +2 offset rows in
  both; the LM head (``lm_head.decoder_weight``) is always its own parameter.
- ``CTRLLMHeadModel`` -> ``CTRLLMHeadModel``: the sinusoidal position table is a (frozen) Paddle
  parameter; transformers computes the same table itself, so it is not exported.
- ``GPTJForCausalLM`` / ``CodeGenForCausalLM`` -> same names in transformers. CodeGen's fused
  ``qkv_proj`` is laid out in ``mp_num=4`` blocks of ``[q, v, k]``; PaddleNLP reads it exactly as
  transformers does, so it only needs the Linear transpose.

Whatever a preset cannot express (e.g. post-LN GPT, OPT's word_embed_proj_dim projections) is
refused with an error naming the config key, before any byte is written.
"""
from __future__ import annotations

import re
from typing import Dict, List

from ...assemble.mapping import MappingError
from .base import MappingContext, Preset, concat, drop, linear, register, rename, split_equal

_FW = "paddlenlp"


# ---- helpers ---------------------------------------------------------------------------------

def _layers(ctx: MappingContext, prefix: str) -> List[int]:
    """Layer indices present in the source names ``{prefix}{N}.…``."""
    rx = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = set()
    for key in ctx.shapes:
        m = rx.match(key)
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def _weight_bias(ctx: MappingContext, src: str, dst: str, transpose: bool) -> List[str]:
    """``src.weight`` (and ``src.bias`` if the model has one) to ``dst.*``."""
    out = [linear(f"{src}.weight", f"{dst}.weight") if transpose else rename(f"{src}.weight", f"{dst}.weight")]
    if ctx.has(f"{src}.bias"):
        out.append(rename(f"{src}.bias", f"{dst}.bias"))
    return out


def _norm(ctx: MappingContext, src: str, dst: str) -> List[str]:
    return _weight_bias(ctx, src, dst, transpose=False)


def _head(ctx: MappingContext, src: str, dst: str = "lm_head.weight", transpose: bool = False) -> List[str]:
    """The output embedding: dropped when it is the input embedding (transformers ties it)."""
    if not ctx.has(src):
        return []
    if ctx.tied:
        return [drop(src)]
    return [linear(src, dst) if transpose else rename(src, dst)]


def _regroup(src: str, tmp: str, num_heads: int, per_head: List[str], axis: int,
             outputs: Dict[str, List[str]]) -> List[str]:
    """A fused projection stored head by head (each head holds ``per_head`` parts of one head width,
    e.g. ``["q", "k", "v"]``) split into heads and regrouped: ``outputs`` maps a destination name to
    the parts it concatenates (all heads of its first part, then all heads of the next, ...)."""
    names = {part: [f"{tmp}.{part}{h}" for h in range(num_heads)] for part in per_head}
    heads = [names[part][h] for h in range(num_heads) for part in per_head]
    out = [split_equal(src, heads, axis)]
    for dst, parts in outputs.items():
        srcs = [n for part in parts for n in names[part]]
        out.append(concat(srcs, dst, axis) if len(srcs) > 1 else rename(srcs[0], dst))
    return out


def _refuse(arch: str, problems: List[str]) -> None:
    if problems:
        raise MappingError(
            f"PaddleNLP {arch}: this model cannot be written as its Hugging Face architecture: "
            + "; ".join(problems)
            + ". Export Paddle names with export.format=paddle_safetensors, or give a mapping with export.aoa"
        )


def _pick(config: dict, keys) -> dict:
    return {k: config[k] for k in keys if k in config}


_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


# ---- GPT -> GPT2LMHeadModel ------------------------------------------------------------------

def _gpt_problems(c: dict) -> List[str]:
    p = []
    if not c.get("normalize_before", True):
        p.append("normalize_before=False (post-LayerNorm blocks; GPT-2 is pre-LayerNorm only)")
    coeff = c.get("scale_qk_coeff", 1.0)
    if coeff is not None and float(coeff) != 1.0:
        p.append(f"scale_qk_coeff={coeff} (Paddle scales attention scores by sqrt(coeff)/sqrt(head_dim); "
                 "GPT-2 has no such factor)")
    act = c.get("hidden_activation", "gelu")
    if act != "gelu":
        p.append(f"hidden_activation={act!r} (PaddleNLP calls it with approximate=True, which only 'gelu' accepts)")
    return p


def _gpt_hf(c: dict) -> dict:
    _refuse("GPTForCausalLM", _gpt_problems(c))
    hidden = c["hidden_size"]
    out = {
        "vocab_size": c["vocab_size"],
        "n_positions": c.get("max_position_embeddings", 512),
        "n_embd": hidden,
        "n_layer": c["num_hidden_layers"],
        "n_head": c["num_attention_heads"],
        "n_inner": c.get("intermediate_size", 4 * hidden),
        "activation_function": "gelu_new",  # F.gelu(x, approximate=True)
        "resid_pdrop": c.get("hidden_dropout_prob", 0.1),
        "embd_pdrop": c.get("hidden_dropout_prob", 0.1),
        "attn_pdrop": c.get("attention_probs_dropout_prob", 0.1),
        "layer_norm_epsilon": 1e-5,  # GPTLayerNorm(..., epsilon=1e-5) everywhere, layer_norm_eps is unused
        "initializer_range": c.get("initializer_range", 0.02),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "use_cache": True,
    }
    out.update(_pick(c, _IDS))
    return out


def _gpt(ctx: MappingContext) -> list:
    _refuse("GPTForCausalLM", _gpt_problems(ctx.config))
    p, t = "gpt", "transformer"
    out = [
        rename(f"{p}.embeddings.word_embeddings.weight", f"{t}.wte.weight"),
        rename(f"{p}.embeddings.position_embeddings.weight", f"{t}.wpe.weight"),
    ]
    out += _norm(ctx, f"{p}.decoder.norm", f"{t}.ln_f")
    heads = int(ctx.get("num_attention_heads"))
    for i in _layers(ctx, f"{p}.decoder.layers."):
        s, d = f"{p}.decoder.layers.{i}", f"{t}.h.{i}"
        out += _norm(ctx, f"{s}.norm1", f"{d}.ln_1")
        out += _norm(ctx, f"{s}.norm2", f"{d}.ln_2")
        a = f"{s}.self_attn"
        if ctx.has(f"{a}.qkv_proj.weight"):
            # [in, heads * (q|k|v)] (reshape to [heads, 3*head_dim], split last) -> [in, q|k|v]
            for kind, axis in (("weight", 1), ("bias", 0)):
                if ctx.has(f"{a}.qkv_proj.{kind}"):
                    out += _regroup(f"{a}.qkv_proj.{kind}", f"{a}.qkv_tmp.{kind}", heads, ["q", "k", "v"], axis,
                                    {f"{d}.attn.c_attn.{kind}": ["q", "k", "v"]})
        else:
            out.append(concat([f"{a}.{x}_proj.weight" for x in "qkv"], f"{d}.attn.c_attn.weight", 1))
            if ctx.has(f"{a}.q_proj.bias"):
                out.append(concat([f"{a}.{x}_proj.bias" for x in "qkv"], f"{d}.attn.c_attn.bias", 0))
        out += _weight_bias(ctx, f"{a}.out_proj", f"{d}.attn.c_proj", transpose=False)  # Conv1D is [in, out]
        out += _weight_bias(ctx, f"{s}.linear1", f"{d}.mlp.c_fc", transpose=False)
        out += _weight_bias(ctx, f"{s}.linear2", f"{d}.mlp.c_proj", transpose=False)
    out += _head(ctx, "lm_head.weight")  # GPTLMHead keeps [vocab, hidden]
    return out


GPT = register(Preset(
    name="gpt_paddlenlp",
    description="PaddleNLP 2.8 GPT (gpt.* names, [in, out] Linear = GPT-2 Conv1D) -> HF GPT2LMHeadModel",
    framework=_FW,
    classes=("GPTForCausalLM",),  # paddlenlp.transformers.GPTLMHeadModel is the same class
    hf_architecture="GPT2LMHeadModel",
    hf_model_type="gpt2",
    statements=_gpt,
    destination_pattern=r"^(transformer\.(wte|wpe)\.weight|transformer\.ln_f\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)"
                        r"|lm_head\.weight)$",
    hf_config=_gpt_hf,
))


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


# ---- OPT -> OPTForCausalLM -------------------------------------------------------------------

# PaddleNLP OPT: "gelu" is nn.GELU(approximate=True); any other name is paddle.nn.functional.<name>
_OPT_ACT = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "swish", "tanh": "tanh",
            "sigmoid": "sigmoid", "relu6": "relu6", "mish": "mish", "hardswish": "hardswish",
            "leaky_relu": "leaky_relu"}


def _opt_problems(c: dict) -> List[str]:
    p = []
    proj, hidden = c.get("word_embed_proj_dim"), c.get("hidden_size")
    if proj is not None and proj != hidden:
        p.append(f"word_embed_proj_dim={proj} != hidden_size={hidden} (PaddleNLP's OPTLMHead is [vocab, hidden_size] "
                 "and cannot follow project_out; HF's is [vocab, word_embed_proj_dim])")
    act = c.get("hidden_act", "relu")
    if act not in _OPT_ACT:
        p.append(f"hidden_act={act!r} has no known transformers equivalent")
    return p


def _opt_hf(c: dict) -> dict:
    _refuse("OPTForCausalLM", _opt_problems(c))
    out = {
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "num_hidden_layers": c["num_hidden_layers"],
        "ffn_dim": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "max_position_embeddings": c["max_position_embeddings"],
        "word_embed_proj_dim": c["hidden_size"],
        "do_layer_norm_before": bool(c.get("normalize_before", True)),
        "_remove_final_layer_norm": False,
        "activation_function": _OPT_ACT[c.get("hidden_act", "relu")],
        "dropout": c.get("hidden_dropout_prob", 0.1),
        "attention_dropout": c.get("attention_probs_dropout_prob", 0.0),
        "layerdrop": 0.0,
        "init_std": c.get("initializer_range", 0.02),
        "enable_bias": True,  # PaddleNLP builds every Linear with a bias whatever enable_bias says
        "layer_norm_elementwise_affine": True,
        "use_cache": True,
    }
    out.update(_pick(c, _IDS))
    return out


def _opt(ctx: MappingContext) -> list:
    _refuse("OPTForCausalLM", _opt_problems(ctx.config))
    if ctx.tied and ctx.has("lm_head.decoder_weight"):
        raise MappingError(
            "PaddleNLP OPTForCausalLM: the LM head (lm_head.decoder_weight) is its own parameter, but the export "
            "treats the model as tied (OPTForCausalLM defines no get_output_embeddings, so config."
            "tie_word_embeddings=True, the PaddleNLP default, is believed); transformers would then replace the "
            "head with the word embedding. Set model.config.tie_word_embeddings = False before exporting"
        )
    p, d0 = "opt", "model.decoder"
    out = [
        rename(f"{p}.embeddings.word_embeddings.weight", f"{d0}.embed_tokens.weight"),
        # OPTLearnedPositionEmbedding: max_position_embeddings + 2 rows, looked up at position + 2 in both
        rename(f"{p}.embeddings.position_embeddings.weight", f"{d0}.embed_positions.weight"),
    ]
    if ctx.has(f"{p}.decoder.final_layer_norm.weight"):
        out += _norm(ctx, f"{p}.decoder.final_layer_norm", f"{d0}.final_layer_norm")
    for i in _layers(ctx, f"{p}.decoder.layers."):
        s, d = f"{p}.decoder.layers.{i}", f"{d0}.layers.{i}"
        out += _norm(ctx, f"{s}.norm1", f"{d}.self_attn_layer_norm")
        out += _norm(ctx, f"{s}.norm2", f"{d}.final_layer_norm")
        a = f"{s}.self_attn"
        # (OPTModel forces config.fuse_attention_qkv=False: there is never a fused qkv_proj)
        for x in "qkv":
            out += _weight_bias(ctx, f"{a}.{x}_proj", f"{d}.self_attn.{x}_proj", True)
        out += _weight_bias(ctx, f"{a}.out_proj", f"{d}.self_attn.out_proj", True)
        out += _weight_bias(ctx, f"{s}.linear1", f"{d}.fc1", True)
        out += _weight_bias(ctx, f"{s}.linear2", f"{d}.fc2", True)
    out += _head(ctx, "lm_head.decoder_weight")  # [vocab, hidden], used with transpose_y
    return out


OPT = register(Preset(
    name="opt_paddlenlp",
    description="PaddleNLP 2.8 OPT (opt.* names, [in, out] Linear, own LM head) -> HF OPTForCausalLM",
    framework=_FW,
    classes=("OPTForCausalLM",),
    hf_architecture="OPTForCausalLM",
    hf_model_type="opt",
    statements=_opt,
    destination_pattern=r"^(model\.decoder\.(embed_tokens|embed_positions)\.weight|model\.decoder\.final_layer_norm\.(weight|bias)"
                        r"|model\.decoder\.layers\.\d+\.(self_attn\.[qkv]_proj|self_attn\.out_proj|self_attn_layer_norm"
                        r"|final_layer_norm|fc1|fc2)\.(weight|bias)|lm_head\.weight)$",
    hf_config=_opt_hf,
))


# ---- CTRL -> CTRLLMHeadModel -----------------------------------------------------------------

def _ctrl_hf(c: dict) -> dict:
    out = _pick(c, ("vocab_size", "n_positions", "n_embd", "dff", "n_layer", "n_head", "resid_pdrop", "embd_pdrop",
                    "layer_norm_epsilon", "initializer_range") + _IDS)
    out["use_cache"] = True
    return out


def _ctrl(ctx: MappingContext) -> list:
    p, t = "ctrl", "transformer"
    out = [
        rename(f"{p}.w.weight", f"{t}.w.weight"),
        # a frozen sinusoid table (stop_gradient) that transformers recomputes identically
        drop(f"{p}.pos_encoding.weight"),
    ]
    out += _norm(ctx, f"{p}.layernorm", f"{t}.layernorm")
    for i in _layers(ctx, f"{p}.h."):
        s, d = f"{p}.h.{i}", f"{t}.h.{i}"
        for lin in ("multi_head_attention.Wq", "multi_head_attention.Wk", "multi_head_attention.Wv",
                    "multi_head_attention.dense", "ffn.0", "ffn.2"):
            out += _weight_bias(ctx, f"{s}.{lin}", f"{d}.{lin}", True)
        out += _norm(ctx, f"{s}.layernorm1", f"{d}.layernorm1")
        out += _norm(ctx, f"{s}.layernorm2", f"{d}.layernorm2")
    out += _head(ctx, "lm_head.weight")  # paddlenlp.layers.Linear stores [out, in] like torch
    if ctx.has("lm_head.bias"):
        out.append(rename("lm_head.bias", "lm_head.bias"))
    return out


CTRL = register(Preset(
    name="ctrl_paddlenlp",
    description="PaddleNLP 2.8 CTRL -> HF CTRLLMHeadModel",
    framework=_FW,
    classes=("CTRLLMHeadModel",),
    hf_architecture="CTRLLMHeadModel",
    hf_model_type="ctrl",
    statements=_ctrl,
    destination_pattern=r"^(transformer\.w\.weight|transformer\.layernorm\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(multi_head_attention\.(Wq|Wk|Wv|dense)|ffn\.[02]|layernorm[12])\.(weight|bias)"
                        r"|lm_head\.(weight|bias))$",
    hf_config=_ctrl_hf,
))


# ---- GPT-J / CodeGen -------------------------------------------------------------------------

# paddlenlp.transformers.activations.ACT2FN: every name means what it means in transformers
_PNLP_ACT2FN = {"gelu", "gelu_10", "gelu_fast", "gelu_new", "gelu_python", "linear", "mish", "quick_gelu", "relu",
                "relu6", "sigmoid", "silu", "swish", "tanh"}


def _rotary_problems(arch: str, c: dict) -> List[str]:
    act = c.get("activation_function", "gelu_new")
    return [] if act in _PNLP_ACT2FN else [f"activation_function={act!r} is not one PaddleNLP's {arch} can build"]


def _gptj_hf(c: dict) -> dict:
    _refuse("GPTJForCausalLM", _rotary_problems("GPT-J", c))
    out = _pick(c, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner",
                    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
                    "initializer_range") + _IDS)
    out["use_cache"] = True
    return out


def _codegen_hf(c: dict) -> dict:
    _refuse("CodeGenForCausalLM", _rotary_problems("CodeGen", c))
    out = _pick(c, ("vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner",
                    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
                    "initializer_range") + _IDS)
    out["use_cache"] = True
    return out


def _gptj_like(ctx: MappingContext, attn_linears) -> list:
    t = "transformer"
    out = [rename(f"{t}.wte.weight", f"{t}.wte.weight")]
    out += _norm(ctx, f"{t}.ln_f", f"{t}.ln_f")
    for i in _layers(ctx, f"{t}.h."):
        s = f"{t}.h.{i}"
        out += _norm(ctx, f"{s}.ln_1", f"{s}.ln_1")
        for lin in attn_linears + ("mlp.fc_in", "mlp.fc_out"):
            out += _weight_bias(ctx, f"{s}.{lin}", f"{s}.{lin}", True)
        for buf in ("attn.bias", "attn.masked_bias", "attn.causal_mask"):  # causal-mask buffers, not weights
            if ctx.has(f"{s}.{buf}"):
                out.append(drop(f"{s}.{buf}"))
    out += _head(ctx, "lm_head.weight", transpose=True)  # nn.Linear(n_embd, vocab): [hidden, vocab]
    if ctx.has("lm_head.bias"):
        out.append(rename("lm_head.bias", "lm_head.bias"))
    return out


def _gptj(ctx: MappingContext) -> list:
    _refuse("GPTJForCausalLM", _rotary_problems("GPT-J", ctx.config))
    return _gptj_like(ctx, ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"))


def _codegen(ctx: MappingContext) -> list:
    _refuse("CodeGenForCausalLM", _rotary_problems("CodeGen", ctx.config))
    # qkv_proj output features: 4 blocks (mp_num) of [q | v | k] each embed_dim/4 wide; PaddleNLP 2.8.1
    # and transformers split them identically, so the fused weight only needs the Linear transpose
    return _gptj_like(ctx, ("attn.qkv_proj", "attn.out_proj"))


_GPTJ_PATTERN = (r"^(transformer\.wte\.weight|transformer\.ln_f\.(weight|bias)"
                 r"|transformer\.h\.\d+\.(ln_1|attn\.(%s)|mlp\.fc_in|mlp\.fc_out)\.(weight|bias)|lm_head\.(weight|bias))$")

GPTJ = register(Preset(
    name="gptj_paddlenlp",
    description="PaddleNLP 2.8 GPT-J -> HF GPTJForCausalLM",
    framework=_FW,
    classes=("GPTJForCausalLM",),
    hf_architecture="GPTJForCausalLM",
    hf_model_type="gptj",
    statements=_gptj,
    destination_pattern=_GPTJ_PATTERN % "q_proj|k_proj|v_proj|out_proj",
    hf_config=_gptj_hf,
))

CODEGEN = register(Preset(
    name="codegen_paddlenlp",
    description="PaddleNLP 2.8 CodeGen (fused qkv_proj in mp_num=4 blocks) -> HF CodeGenForCausalLM",
    framework=_FW,
    classes=("CodeGenForCausalLM",),
    hf_architecture="CodeGenForCausalLM",
    hf_model_type="codegen",
    statements=_codegen,
    destination_pattern=_GPTJ_PATTERN % "qkv_proj|out_proj",
    hf_config=_codegen_hf,
))

