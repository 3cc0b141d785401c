"""The vocabulary presets are declared in: tables of ``paddle name -> hf name, operation``.

A preset's statements are a few tables, one row a module (``.weight`` / ``.bias`` are the
operation's business)::

    _LAYER = [
        ("ln_1", "input_layernorm", AS_IS),            # .weight (and .bias, if the model has one) renamed
        ("attn.c_proj", "self_attn.o_proj", LINEAR),   # .weight transposed ([in, out] -> [out, in]), .bias renamed
        ("attn.c_attn", "self_attn.{}_proj", Fused(QKV)),  # split into q_proj, k_proj, v_proj
        ("post_attention_layernorm", optional(AS_IS)),  # the same name on both sides; only if the model has it
    ]

    def _statements(ctx):
        return (table(ctx, [("qwen.wte", "model.embed_tokens", AS_IS), ("qwen.ln_f", "model.norm", AS_IS)])
                + layers(ctx, "qwen.h", "model.layers", _LAYER)
                + lm_head(ctx, "lm_head.weight", transpose=True))

and its config.json a table too (:func:`translate`: keys copied, renamed, computed or set). What
is left in a preset module is what only that model has: refusals with their reasons, RoPE
translations, the layout of a fused tensor.

An operation is any ``op(ctx, src, dst) -> [statement, ...]``; the ones here produce the strings of
:mod:`.base`, which AOAEngine runs.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ...assemble.mapping import MappingError
from ...config.schema import ConfigError
from .base import MappingContext, concat, drop, linear, rename, split_heads

Op = Callable[[MappingContext, str, str], List[str]]
Row = Union[Tuple[str, Op], Tuple[str, str, Op]]  # (name, op): the same name on both sides
Layout = List[Tuple[str, int]]  # blocks of a fused tensor along its output features: (part, number of heads)

# in a row's names, AOAEngine expands it over every expert index present in the source names
# (layers are enumerated by :func:`layers`, so that an operation can look at each layer's tensors)
EXPERT = "$EXPERT_ID"


# ---- operations on one module ---------------------------------------------------------------

def _weight_bias(transpose: bool) -> Op:
    def op(ctx: MappingContext, src: str, dst: str) -> List[str]:
        out = [(linear if transpose else rename)(f"{src}.weight", f"{dst}.weight")]
        if ctx.has(f"{src}.bias"):
            out.append(rename(f"{src}.bias", f"{dst}.bias"))
        return out
    return op


AS_IS = _weight_bias(False)  # norms, embeddings, GPT-2's Conv1D ([in, out] like Paddle's Linear)
LINEAR = _weight_bias(True)  # Paddle nn.Linear [in, out] -> torch nn.Linear [out, in]


def DROP(ctx: MappingContext, src: str, dst: str = "") -> List[str]:  # noqa: N802 (an operation, like the others)
    """A tensor that is not a weight (a buffer: causal mask, rotary table), dropped if the model has it.
    Its row names the tensor itself, not a module."""
    return [drop(src)] if ctx.has(src) else []


def optional(op: Op) -> Op:
    """``op`` only where the model has the row's source weight (e.g. a norm some configs leave out,
    or one of two layouts of a layer: fused and separate tensors)."""
    probe = getattr(op, "probe", None) or (lambda src: f"{src}.weight")

    def run(ctx: MappingContext, src: str, dst: str) -> List[str]:
        return op(ctx, src, dst) if ctx.has(probe(src)) else []
    return run


QKV: Layout = [("q", 1), ("k", 1), ("v", 1)]  # q, k, v contiguous, equal thirds
GATE_UP: Layout = [("gate", 1), ("up", 1)]


@dataclass(frozen=True)
class Fused:
    """A fused projection split along its output features and regrouped.

    ``layout``: the blocks along the output features in order, as (part, number of heads) of one
    width, e.g. ``[("q", 2), ("k", 1), ("v", 1)] * kv_heads`` for q/k/v interleaved per key-value
    group; or a function ``(ctx, weight name) -> layout`` (which may refuse the tensor). The heads of
    a part are concatenated in order into ``dst.format(part)``; with ``merge``, all heads of every part
    (the first part's, then the next's) into ``dst``. ``transpose``: Paddle Linear [in, out] to
    torch [out, in]; False keeps [in, out] (GPT-2 Conv1D). A ``.bias`` (if any) is split alike.
    """

    layout: Union[Layout, Callable[[MappingContext, str], Layout]]
    transpose: bool = True
    merge: bool = False

    def __call__(self, ctx: MappingContext, src: str, dst: str) -> List[str]:
        layout = self.layout(ctx, f"{src}.weight") if callable(self.layout) else self.layout
        parts = list(dict.fromkeys(part for part, _ in layout))

        def outputs(kind: str) -> Dict[str, List[str]]:
            return {f"{dst}.{kind}": parts} if self.merge else {f"{dst.format(p)}.{kind}": [p] for p in parts}

        tmp = f"__tmp__.{src}"
        if self.transpose:
            out = [linear(f"{src}.weight", f"{tmp}.weight.T")]  # [out, in]: heads along axis 0
            out += split_heads(f"{tmp}.weight.T", f"{tmp}.w", layout, axis=0, outputs=outputs("weight"))
        else:
            out = split_heads(f"{src}.weight", f"{tmp}.w", layout, axis=1, outputs=outputs("weight"))
        if ctx.has(f"{src}.bias"):
            out += split_heads(f"{src}.bias", f"{tmp}.b", layout, axis=0, outputs=outputs("bias"))
        return out


@dataclass(frozen=True)
class Concat:
    """Separate projections ``src.format(part)`` concatenated along their output features into one
    ``dst`` (weights as is, [in, out]: GPT-2's Conv1D); their biases too, if the model has them."""

    parts: Sequence[str]

    def probe(self, src: str) -> str:
        return f"{src.format(self.parts[0])}.weight"

    def __call__(self, ctx: MappingContext, src: str, dst: str) -> List[str]:
        out = [concat([f"{src.format(p)}.weight" for p in self.parts], f"{dst}.weight", 1)]
        if ctx.has(f"{src.format(self.parts[0])}.bias"):
            out.append(concat([f"{src.format(p)}.bias" for p in self.parts], f"{dst}.bias", 0))
        return out


@dataclass(frozen=True)
class PaddleMacro:
    """A fused tensor split by one of Paddle's own AOA macros (``fused_qkv``, ``fused_ffn``), which
    follow the number of tensor-parallel slices the source is held in; the parts, Paddle Linear
    weights, are then transposed. ``attrs(ctx)``: the macro's settings (e.g. ``num_heads``)."""

    macro: str
    parts: Sequence[str]
    attrs: Optional[Callable[[MappingContext], Dict[str, Any]]] = None

    def __call__(self, ctx: MappingContext, src: str, dst: str) -> List[str]:
        settings = "".join(f", {k}={v}" for k, v in (self.attrs(ctx) if self.attrs else {}).items())
        outs = [dst.format(p) for p in self.parts]
        out = [f"{src}.weight -> {', '.join(o + '.weight' for o in outs)}, {self.macro}{settings}"]
        if ctx.has(f"{src}.bias"):
            out.append(f"{src}.bias -> {', '.join(o + '.bias' for o in outs)}, {self.macro}{settings}, axis=0")
        # the parts are intermediates of the macro: transposed in place
        return out + [linear(f"{o}.weight", f"{o}.weight") for o in outs]


# ---- tables ---------------------------------------------------------------------------------

def table(ctx: MappingContext, rows: Sequence[Row], src_prefix: str = "", dst_prefix: str = "") -> List[str]:
    """The statements of ``rows`` (``(src, dst, op)`` or ``(name, op)``), names under the prefixes."""
    sp = f"{src_prefix}." if src_prefix else ""
    dp = f"{dst_prefix}." if dst_prefix else ""
    out = []
    for row in rows:
        src, dst, op = row if len(row) == 3 else (row[0], row[0], row[1])
        out += op(ctx, sp + src, dp + dst)
    return out


def layer_ids(ctx: MappingContext, prefix: str) -> List[int]:
    """The layer indices present under ``prefix`` (e.g. ``llama.layers``: ``llama.layers.N.*``)."""
    rx = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.")
    return sorted({int(m.group(1)) for k in ctx.shapes for m in [rx.match(k)] if m})


def layers(ctx: MappingContext, src_prefix: str, dst_prefix: str, rows: Sequence[Row]) -> List[str]:
    """``rows`` for every layer ``N`` the model has (``{src_prefix}.N.*`` -> ``{dst_prefix}.N.*``)."""
    out = []
    for i in layer_ids(ctx, src_prefix):
        out += table(ctx, rows, f"{src_prefix}.{i}", f"{dst_prefix}.{i}")
    return out


def lm_head(ctx: MappingContext, src: str = "lm_head.weight", transpose: bool = False,
            bias: Optional[str] = None) -> List[str]:
    """The output embedding, if the model has it: dropped when it is the input embedding
    (transformers ties it), else ``lm_head.weight`` (``transpose``: from Paddle's [in, out]);
    ``bias`` (a tensor name), if the model has it, ``lm_head.bias`` either way."""
    out = []
    if ctx.has(src):
        out.append(drop(src) if ctx.tied else (linear if transpose else rename)(src, "lm_head.weight"))
    if bias and ctx.has(bias):
        out.append(rename(bias, "lm_head.bias"))
    return out


# ---- config.json ----------------------------------------------------------------------------

_REQUIRED = object()
KEEP = object()  # the same key, copied if the model config has it


@dataclass(frozen=True)
class From:
    """A config.json value read from the model config's ``key`` (``default`` when the key is absent;
    without one the key is required), passed through ``then`` if given."""

    key: str
    default: Any = _REQUIRED
    then: Optional[Callable[[Any], Any]] = None

    def __call__(self, c: dict) -> Any:
        value = c[self.key] if self.default is _REQUIRED else c.get(self.key, self.default)
        return self.then(value) if self.then else value


IDS = {"bos_token_id": KEEP, "eos_token_id": KEEP, "pad_token_id": KEEP}


def translate(c: dict, keys: Dict[str, Any]) -> dict:
    """config.json from a table ``{hf key: how}``, in its order: ``KEEP`` (copied if present), a
    :class:`From`, a function of the model config, or a value (set as is)."""
    out = {}
    for key, how in keys.items():
        if how is KEEP:
            if key in c:
                out[key] = c[key]
        elif callable(how):
            out[key] = how(c)
        else:
            out[key] = copy.deepcopy(how)
    return out


def config_table(keys: Dict[str, Any]) -> Callable[[dict], dict]:
    """A preset's ``hf_config`` that is the table ``keys`` alone (see :func:`translate`)."""
    return lambda c: translate(c, keys)


# ---- refusals -------------------------------------------------------------------------------

def refuse(preset: str, why: str):
    """A model this preset cannot write as its Hugging Face architecture (a recipe-level error)."""
    raise ConfigError("export.aoa", f"preset {preset!r}: {why}")


def cannot_export(framework: str, arch: str, problems: List[str]) -> None:
    """Refuse the model if ``problems`` (what its Hugging Face architecture cannot express) is not empty."""
    if problems:
        raise MappingError(
            f"{framework} {arch}: this model cannot be written as its Hugging Face architecture: "
            + "; ".join(problems)
            + ". Export Paddle names with export.format=paddle_safetensors, or give a mapping with export.aoa"
        )
