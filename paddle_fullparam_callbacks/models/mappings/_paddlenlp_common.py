"""Helpers shared by the PaddleNLP 2.8 GPT-family presets (string builders over ``MappingContext``)."""
from __future__ import annotations

import re
from typing import Dict, List

from ...assemble.mapping import MappingError
from .base import MappingContext, concat, drop, linear, rename, split_equal

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
