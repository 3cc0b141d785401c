"""PaddleNLP 2.8 OPT and CTRL -> Hugging Face ``OPTForCausalLM`` and ``CTRLLMHeadModel``.

- ``OPTForCausalLM``: the learned positions carry the same +2 offset rows in both; the LM head
  (``lm_head.decoder_weight``) is always its own parameter.
- ``CTRLLMHeadModel``: the sinusoidal position table is a (frozen) Paddle parameter; transformers
  computes the same table itself, so it is not exported.
"""
from __future__ import annotations

from typing import List

from ...assemble.mapping import MappingError
from ._paddlenlp_common import _FW, _IDS, _head, _layers, _norm, _pick, _refuse, _weight_bias
from .base import MappingContext, Preset, drop, register, rename


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


