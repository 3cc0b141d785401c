"""Whether a job's snapshots fit the model an engine serves: the architecture and every tensor's name and
shape. vLLM 0.32 reloads a directory of other shapes without an error and then serves another model, and it
keeps its own tensor for a name a snapshot lacks: this check, at start, is what stops both.

:func:`fit_problems` is pure; :func:`read_model_dir` reads what it compares from a model directory (its
``config.json`` and its safetensors headers, never the tensors).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ...export.write.header import SafetensorsFormatError, read_header

BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Buffers some checkpoints carry and engines recompute (never a reason to refuse)."""
EXAMPLES = 3
ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
"""Every safetensors dtype code: an engine's model may hold any of them (only the shapes are compared)."""


def fit_problems(ours: Tuple[Optional[str], Dict[str, tuple]], theirs: Tuple[Optional[str], Dict[str, tuple]]) -> List[str]:
    """What keeps snapshots ``ours`` = (architecture, {tensor: shape}) from replacing the weights of an engine's
    model ``theirs``; [] when they fit.

    >>> fit_problems(("LlamaForCausalLM", {"a": (2, 3)}), ("LlamaForCausalLM", {"a": (2, 3), "x.rotary_emb.inv_freq": (4,)}))
    []
    >>> fit_problems(("LlamaForCausalLM", {"a": (2, 3)}), ("LlamaForCausalLM", {"a": (2, 4)}))
    ['1 tensor(s) have other shapes: a: the snapshots [2, 3], the engine [2, 4]']
    """
    (arch, mine), (their_arch, served) = ours, theirs
    out = []
    if arch and their_arch and arch != their_arch:
        out.append(f"the engine serves a {their_arch}, the snapshots hold a {arch}")
    served = {k: v for k, v in served.items() if not BUFFERS.search(k)}
    lacking = sorted(set(served) - set(mine))
    extra = sorted(set(mine) - set(served))
    other = sorted(k for k in set(mine) & set(served) if tuple(mine[k]) != tuple(served[k]))
    if other:
        out.append(f"{len(other)} tensor(s) have other shapes: " + ", ".join(
            f"{k}: the snapshots {list(mine[k])}, the engine {list(served[k])}" for k in other[:EXAMPLES]))
    if lacking:
        out.append(f"the engine's model has {len(lacking)} tensor(s) the snapshots lack (it would keep serving its "
                   f"own): {', '.join(lacking[:EXAMPLES])}")
    if extra:
        out.append(f"the snapshots hold {len(extra)} tensor(s) the engine's model does not have: "
                   f"{', '.join(extra[:EXAMPLES])}")
    return out


def read_model_dir(path: "str | Path") -> Tuple[Optional[str], Dict[str, tuple]]:
    """(the first of ``config.json``'s ``architectures``, {tensor: shape} of its safetensors files); OSError
    or ValueError when the directory cannot be read as a model."""
    d = Path(path)
    config = json.loads((d / "config.json").read_text())
    archs = config.get("architectures") if isinstance(config, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d} holds no safetensors file")
    tensors: Dict[str, tuple] = {}
    for name in files:
        if "/" in name or name.startswith("."):
            raise ValueError(f"{d}: the index names {name!r}, not a file of the directory")
        try:
            _, entries, _ = read_header(d / name, extra_codes=ITEM_SIZES)
        except SafetensorsFormatError as e:
            raise ValueError(str(e)) from e
        tensors.update({k: tuple(e.shape) for k, e in entries.items()})
    return arch, tensors
