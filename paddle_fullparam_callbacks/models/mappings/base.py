"""The preset contract: how this package maps a model family that lacks (or gets wrong) its own
Hugging Face mapping.

A :class:`Preset` turns a model's config and source tensors into AOA statements (run through
Paddle's AOAEngine like any other mapping), says which Hugging Face architecture the result is,
and translates the model's config into that architecture's ``config.json``. ``export.aoa=auto``
picks a preset by the model's framework and class name only (:data:`AUTO`), never by guessing
from parameter names.

The statement helpers here are small string builders; presets are declared with the tables and
operations of :mod:`.builders`, made of them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class MappingContext:
    """What a preset may look at: the model config (as a dict), whether the output embedding is the
    input embedding, the source tensors (name -> global shape) and the parallel degrees."""

    config: dict
    tied: bool
    shapes: Dict[str, Tuple[int, ...]]
    # the parallel degrees the model was built with (``config`` holds the single-process values):
    # a fused tensor's global layout can depend on them, e.g. {"tensor_parallel_degree": 2}
    parallel: Dict[str, int] = field(default_factory=dict)

    def has(self, key: str) -> bool:
        return key in self.shapes

    def has_any(self, pattern: str) -> bool:
        rx = re.compile(pattern)
        return any(rx.search(k) for k in self.shapes)

    def get(self, key: str, default=None):
        value = self.config.get(key)
        return default if value is None else value


@dataclass(frozen=True)
class Preset:
    """A mapping from one framework's model family to one Hugging Face architecture."""

    name: str
    description: str
    framework: str  # "paddlenlp" | "paddleformers"
    classes: Tuple[str, ...]  # model classes that export.aoa=auto maps with this preset
    hf_architecture: str  # e.g. "LlamaForCausalLM"
    hf_model_type: str  # e.g. "llama"
    statements: Callable[[MappingContext], List[str]]
    destination_pattern: str  # every destination name must match: catches sources left unmapped
    hf_config: Optional[Callable[[dict], dict]] = None  # model config -> HF config keys (None: as is)
    lm_head: Optional[str] = "lm_head.weight"  # the HF name of an untied output embedding


PRESETS: Dict[str, Preset] = {}
AUTO: Dict[Tuple[str, str], str] = {}  # (framework, class name) -> preset name


def register(preset: Preset) -> Preset:
    if preset.name in PRESETS:
        raise ValueError(f"preset {preset.name!r} registered twice")
    PRESETS[preset.name] = preset
    for cls in preset.classes:
        key = (preset.framework, cls)
        if key in AUTO:
            raise ValueError(f"{cls} of {preset.framework} is claimed by presets {AUTO[key]!r} and {preset.name!r}")
        AUTO[key] = preset.name
    return preset


# ---- statement builders ---------------------------------------------------------------------

def rename(src: str, dst: str) -> str:
    return f"{src} -> {dst}"


def linear(src: str, dst: str) -> str:
    """A Paddle ``nn.Linear`` weight ([in, out]) to a torch one ([out, in])."""
    return f"{src}^T -> {dst}"


def drop(src: str) -> str:
    return f"{src} -> _"


def split_equal(src: str, dsts: List[str], axis: int) -> str:
    return f"{src} -> {', '.join(dsts)}, axis={axis}"


def concat(srcs: List[str], dst: str, axis: int) -> str:
    return f"{', '.join(srcs)} -> {dst}, axis={axis}"


def split_heads(src: str, tmp: str, layout: List[Tuple[str, int]], axis: int, outputs: Dict[str, List[str]]) -> List[str]:
    """Split a fused projection into heads and regroup them.

    ``layout``: the fused tensor's blocks along ``axis`` in order, as (part, number of heads), e.g.
    ``[("q", 2), ("k", 1), ("v", 1)] * num_kv_heads`` for q/k/v interleaved per key-value group.
    Every head has the same width. ``outputs``: destination name -> the parts it concatenates (all
    heads of its first part in the order they appear, then those of the next part, ...).
    """
    heads, parts = [], {}
    for part, n in layout:
        for _ in range(n):
            name = f"{tmp}.{part}{len(parts.setdefault(part, []))}"
            parts[part].append(name)
            heads.append(name)
    out = [split_equal(src, heads, axis)]
    for dst, wanted in outputs.items():
        srcs = [h for part in wanted for h in parts[part]]
        out.append(concat(srcs, dst, axis) if len(srcs) > 1 else rename(srcs[0], dst))
    return out
