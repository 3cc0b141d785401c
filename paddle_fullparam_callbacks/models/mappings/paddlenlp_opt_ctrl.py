"""PaddleNLP 2.8 OPT and CTRL -> Hugging Face ``OPTForCausalLM`` and ``CTRLLMHeadModel``.

- ``OPTForCausalLM``: the learned positions carry the same +2 offset rows in both; the LM head
  (``lm_head.decoder_weight``) is always its own parameter.
- ``CTRLLMHeadModel``: the sinusoidal position table is a (frozen) Paddle parameter; transformers
  computes the same table itself, so it is not exported.
"""
from __future__ import annotations

from typing import List

from ...assemble.mapping import MappingError
from ._paddlenlp_common import paddlenlp_preset
from .base import MappingContext
from .builders import AS_IS, DROP, IDS, KEEP, LINEAR, From, config_table, layers, lm_head, optional, table


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


_OPT_CONFIG = {
    "vocab_size": From("vocab_size"),
    "hidden_size": From("hidden_size"),
    "num_hidden_layers": From("num_hidden_layers"),
    "ffn_dim": From("intermediate_size"),
    "num_attention_heads": From("num_attention_heads"),
    "max_position_embeddings": From("max_position_embeddings"),
    "word_embed_proj_dim": From("hidden_size"),
    "do_layer_norm_before": From("normalize_before", True, bool),
    "_remove_final_layer_norm": False,
    "activation_function": From("hidden_act", "relu", _OPT_ACT.get),
    "dropout": From("hidden_dropout_prob", 0.1),
    "attention_dropout": From("attention_probs_dropout_prob", 0.0),
    "layerdrop": 0.0,
    "init_std": From("initializer_range", 0.02),
    "enable_bias": True,  # PaddleNLP builds every Linear with a bias whatever enable_bias says
    "layer_norm_elementwise_affine": True,
    "use_cache": True,
    **IDS,
}
_OPT_LAYER = [
    ("norm1", "self_attn_layer_norm", AS_IS),
    ("norm2", "final_layer_norm", AS_IS),
    # (OPTModel forces config.fuse_attention_qkv=False: there is never a fused qkv_proj)
    *[(f"self_attn.{x}_proj", f"self_attn.{x}_proj", LINEAR) for x in "qkv"],
    ("self_attn.out_proj", "self_attn.out_proj", LINEAR),
    ("linear1", "fc1", LINEAR),
    ("linear2", "fc2", LINEAR),
]


def _opt(ctx: MappingContext) -> list:
    if ctx.tied and ctx.has("lm_head.decoder_weight"):
        raise MappingError(
            "PaddleNLP OPTForCausalLM: the LM head (lm_head.decoder_weight) is its own parameter, but the export "
            "treats the model as tied (OPTForCausalLM defines no get_output_embeddings, so config."
            "tie_word_embeddings=True, the PaddleNLP default, is believed); transformers would then replace the "
            "head with the word embedding. Set model.config.tie_word_embeddings = False before exporting"
        )
    top = [("embeddings.word_embeddings", "decoder.embed_tokens", AS_IS),
           # OPTLearnedPositionEmbedding: max_position_embeddings + 2 rows, looked up at position + 2 in both
           ("embeddings.position_embeddings", "decoder.embed_positions", AS_IS),
           ("decoder.final_layer_norm", "decoder.final_layer_norm", optional(AS_IS))]
    return (table(ctx, top, "opt", "model")
            + layers(ctx, "opt.decoder.layers", "model.decoder.layers", _OPT_LAYER)
            + lm_head(ctx, "lm_head.decoder_weight"))  # [vocab, hidden], used with transpose_y


OPT = paddlenlp_preset(
    "opt_paddlenlp", "OPTForCausalLM", _opt, config_table(_OPT_CONFIG), _opt_problems,
    description="PaddleNLP 2.8 OPT (opt.* names, [in, out] Linear, own LM head) -> HF OPTForCausalLM",
    hf_architecture="OPTForCausalLM",
    hf_model_type="opt",
    destination_pattern=r"^(model\.decoder\.(embed_tokens|embed_positions)\.weight|model\.decoder\.final_layer_norm\.(weight|bias)"
                        r"|model\.decoder\.layers\.\d+\.(self_attn\.[qkv]_proj|self_attn\.out_proj|self_attn_layer_norm"
                        r"|final_layer_norm|fc1|fc2)\.(weight|bias)|lm_head\.weight)$",
)


# ---- CTRL -> CTRLLMHeadModel -----------------------------------------------------------------

_CTRL_KEYS = ("vocab_size", "n_positions", "n_embd", "dff", "n_layer", "n_head", "resid_pdrop", "embd_pdrop",
              "layer_norm_epsilon", "initializer_range")
_CTRL_LAYER = [
    *[(lin, LINEAR) for lin in ("multi_head_attention.Wq", "multi_head_attention.Wk", "multi_head_attention.Wv",
                                "multi_head_attention.dense", "ffn.0", "ffn.2")],
    ("layernorm1", AS_IS),
    ("layernorm2", AS_IS),
]


def _ctrl(ctx: MappingContext) -> list:
    top = [("ctrl.w", "transformer.w", AS_IS),
           # a frozen sinusoid table (stop_gradient) that transformers recomputes identically
           ("ctrl.pos_encoding.weight", DROP),
           ("ctrl.layernorm", "transformer.layernorm", AS_IS)]
    return (table(ctx, top)
            + layers(ctx, "ctrl.h", "transformer.h", _CTRL_LAYER)
            # paddlenlp.layers.Linear stores [out, in] like torch
            + lm_head(ctx, bias="lm_head.bias"))


CTRL = paddlenlp_preset(
    "ctrl_paddlenlp", "CTRLLMHeadModel", _ctrl, config_table({**{k: KEEP for k in _CTRL_KEYS}, **IDS, "use_cache": True}),
    description="PaddleNLP 2.8 CTRL -> HF CTRLLMHeadModel",
    hf_architecture="CTRLLMHeadModel",
    hf_model_type="ctrl",
    destination_pattern=r"^(transformer\.w\.weight|transformer\.layernorm\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(multi_head_attention\.(Wq|Wk|Wv|dense)|ffn\.[02]|layernorm[12])\.(weight|bias)"
                        r"|lm_head\.(weight|bias))$",
)
