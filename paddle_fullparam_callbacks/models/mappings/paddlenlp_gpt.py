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

from ._paddlenlp_common import _FW, _IDS, _head, _layers, _norm, _pick, _refuse, _regroup, _weight_bias
from .base import MappingContext, Preset, concat, drop, register, rename


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

