"""PaddleNLP 2.8 GPT lineage -> Hugging Face: ``GPTForCausalLM`` (-> ``GPT2LMHeadModel``),
``GPTJForCausalLM``, ``CodeGenForCausalLM``.

PaddleNLP 2.8.1 writes no Hugging Face format for any of these, so every layout detail below was
read from both implementations (PaddleNLP 2.8.1, transformers 5.x) and checked on tiny models:

- ``GPTForCausalLM`` (``GPTLMHeadModel`` is an alias of it) -> ``GPT2LMHeadModel``. HF GPT-2 uses
  ``Conv1D`` (``[in, out]``, like Paddle's Linear): no transposes. Separate q/k/v are concatenated
  into ``c_attn``; a fused ``qkv_proj`` is stored per head as ``[q_h, k_h, v_h]`` and regrouped.
  The LM head is always the word embedding. Paddle's GPT layer norms use eps 1e-5 whatever
  ``layer_norm_eps`` says, and its "gelu" is the tanh approximation (``gelu_new``).
- ``GPTJForCausalLM`` / ``CodeGenForCausalLM`` -> same names in transformers. CodeGen's fused
  ``qkv_proj`` is laid out in ``mp_num=4`` blocks of ``[q, v, k]``; PaddleNLP reads it exactly as
  transformers does, so it only needs the Linear transpose.

Whatever a preset cannot express (e.g. post-LN GPT) is refused with an error naming the config
key, before any byte is written.
"""
from __future__ import annotations

from typing import List

from ._paddlenlp_common import paddlenlp_preset
from .base import MappingContext
from .builders import AS_IS, DROP, IDS, KEEP, LINEAR, QKV, Concat, From, Fused, config_table, layers, lm_head, optional, table


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


_GPT_CONFIG = {
    "vocab_size": From("vocab_size"),
    "n_positions": From("max_position_embeddings", 512),
    "n_embd": From("hidden_size"),
    "n_layer": From("num_hidden_layers"),
    "n_head": From("num_attention_heads"),
    "n_inner": lambda c: c.get("intermediate_size", 4 * c["hidden_size"]),
    "activation_function": "gelu_new",  # F.gelu(x, approximate=True)
    "resid_pdrop": From("hidden_dropout_prob", 0.1),
    "embd_pdrop": From("hidden_dropout_prob", 0.1),
    "attn_pdrop": From("attention_probs_dropout_prob", 0.1),
    "layer_norm_epsilon": 1e-5,  # GPTLayerNorm(..., epsilon=1e-5) everywhere, layer_norm_eps is unused
    "initializer_range": From("initializer_range", 0.02),
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "use_cache": True,
    **IDS,
}


def _gpt_qkv_per_head(ctx: MappingContext, weight: str):
    # [in, heads * (q|k|v)] (the forward reshapes to [heads, 3*head_dim] and splits the last axis)
    return QKV * int(ctx.get("num_attention_heads"))


# HF GPT-2 uses Conv1D ([in, out], like Paddle's Linear): no transposes
_GPT_LAYER = [
    ("norm1", "ln_1", AS_IS),
    ("norm2", "ln_2", AS_IS),
    # a fused qkv_proj is regrouped into c_attn [q | k | v]; separate q/k/v are concatenated into it
    ("self_attn.qkv_proj", "attn.c_attn", optional(Fused(_gpt_qkv_per_head, transpose=False, merge=True))),
    ("self_attn.{}_proj", "attn.c_attn", optional(Concat("qkv"))),
    ("self_attn.out_proj", "attn.c_proj", AS_IS),
    ("linear1", "mlp.c_fc", AS_IS),
    ("linear2", "mlp.c_proj", AS_IS),
]


def _gpt(ctx: MappingContext) -> list:
    return (table(ctx, [("embeddings.word_embeddings", "wte", AS_IS), ("embeddings.position_embeddings", "wpe", AS_IS),
                        ("decoder.norm", "ln_f", AS_IS)], "gpt", "transformer")
            + layers(ctx, "gpt.decoder.layers", "transformer.h", _GPT_LAYER)
            + lm_head(ctx))  # GPTLMHead keeps [vocab, hidden]


GPT = paddlenlp_preset(
    "gpt_paddlenlp", "GPTForCausalLM",  # paddlenlp.transformers.GPTLMHeadModel is the same class
    _gpt, config_table(_GPT_CONFIG), _gpt_problems,
    description="PaddleNLP 2.8 GPT (gpt.* names, [in, out] Linear = GPT-2 Conv1D) -> HF GPT2LMHeadModel",
    hf_architecture="GPT2LMHeadModel",
    hf_model_type="gpt2",
    destination_pattern=r"^(transformer\.(wte|wpe)\.weight|transformer\.ln_f\.(weight|bias)"
                        r"|transformer\.h\.\d+\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)"
                        r"|lm_head\.weight)$",
)


# ---- GPT-J / CodeGen -------------------------------------------------------------------------

# paddlenlp.transformers.activations.ACT2FN: every name means what it means in transformers
_PNLP_ACT2FN = {"gelu", "gelu_10", "gelu_fast", "gelu_new", "gelu_python", "linear", "mish", "quick_gelu", "relu",
                "relu6", "sigmoid", "silu", "swish", "tanh"}


def _rotary_problems(arch: str):
    def problems(c: dict) -> List[str]:
        act = c.get("activation_function", "gelu_new")
        return [] if act in _PNLP_ACT2FN else [f"activation_function={act!r} is not one PaddleNLP's {arch} can build"]
    return problems


_GPTJ_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "rotary_dim", "n_inner", "activation_function",
              "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range")
_GPTJ_CONFIG = {**{k: KEEP for k in _GPTJ_KEYS}, **IDS, "use_cache": True}
# CodeGen's config has n_ctx too (after n_positions)
_CODEGEN_CONFIG = {**{k: KEEP for k in _GPTJ_KEYS[:2] + ("n_ctx",) + _GPTJ_KEYS[2:]}, **IDS, "use_cache": True}


def _gptj_like(attn_linears):
    rows = [("ln_1", AS_IS), *[(lin, LINEAR) for lin in attn_linears + ("mlp.fc_in", "mlp.fc_out")],
            # causal-mask buffers, not weights
            ("attn.bias", DROP), ("attn.masked_bias", DROP), ("attn.causal_mask", DROP)]

    def statements(ctx: MappingContext) -> list:
        return (table(ctx, [("transformer.wte", AS_IS), ("transformer.ln_f", AS_IS)])
                + layers(ctx, "transformer.h", "transformer.h", rows)
                # nn.Linear(n_embd, vocab): [hidden, vocab]
                + lm_head(ctx, transpose=True, bias="lm_head.bias"))
    return statements


_GPTJ_PATTERN = (r"^(transformer\.wte\.weight|transformer\.ln_f\.(weight|bias)"
                 r"|transformer\.h\.\d+\.(ln_1|attn\.(%s)|mlp\.fc_in|mlp\.fc_out)\.(weight|bias)|lm_head\.(weight|bias))$")

GPTJ = paddlenlp_preset(
    "gptj_paddlenlp", "GPTJForCausalLM",
    _gptj_like(("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj")), config_table(_GPTJ_CONFIG),
    _rotary_problems("GPT-J"),
    description="PaddleNLP 2.8 GPT-J -> HF GPTJForCausalLM",
    hf_architecture="GPTJForCausalLM",
    hf_model_type="gptj",
    destination_pattern=_GPTJ_PATTERN % "q_proj|k_proj|v_proj|out_proj",
)

CODEGEN = paddlenlp_preset(
    "codegen_paddlenlp", "CodeGenForCausalLM",
    # qkv_proj output features: 4 blocks (mp_num) of [q | v | k] each embed_dim/4 wide; PaddleNLP 2.8.1
    # and transformers split them identically, so the fused weight only needs the Linear transpose
    _gptj_like(("attn.qkv_proj", "attn.out_proj")), config_table(_CODEGEN_CONFIG), _rotary_problems("CodeGen"),
    description="PaddleNLP 2.8 CodeGen (fused qkv_proj in mp_num=4 blocks) -> HF CodeGenForCausalLM",
    hf_architecture="CodeGenForCausalLM",
    hf_model_type="codegen",
    destination_pattern=_GPTJ_PATTERN % "qkv_proj|out_proj",
)
