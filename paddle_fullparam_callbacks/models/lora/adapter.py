"""The PEFT adapter of a LoRA model: its tensors derived from the weights' own name mapping.

HF peft holds, per targeted ``nn.Linear`` ``<module>`` of the Hugging Face model,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``, and
merges ``W + (lora_B @ lora_A) * scaling``. Paddle's layer holds ``A [in, r]`` and ``B [r, out]``
over its weight ``W [in, out]``. No table per architecture is needed: the snapshot's mapping
already says, for each Hugging Face weight, which columns of which Paddle weight it is made of
(transposed). Since ``W + A @ B``'s column ``j`` is ``W[:, j] + A @ B[:, j]``, the adapter of a
destination made of columns ``C`` of one LoRA weight is ``A^T`` (whole, repeated for every
destination of a fused weight) and the rows ``C`` of ``B^T``, in the destination's order: a fused
q/k/v weight split per key-value head gives q, k and v exactly the ``B`` columns their weights got.

Refused (the snapshot itself is unaffected): a destination made of several LoRA layers (peft has
one LoRA module per weight), or of a part of a weight's input rows, or not transposed; a layer
whose scaling is not ``alpha / r`` (or ``alpha / sqrt(r)``) with the run's ``r`` and ``alpha``
(PaddleNLP's PiSSA, whose adapter applies to a residual base the snapshot does not hold).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...assemble.arrays import permutations_and_cast
from ...assemble.mapping import DestinationMap
from ...plan.export_plan import TensorSpec, natural_key
from .layers import LoraError

PREFIX = "base_model.model."
DIRECTORY = "adapter"
FILE_PREFIX = "adapter_model"
CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class Desc:
    """A region of a tensor, with the attributes the assemblers read from Paddle's ShardedWeightDesc."""

    key: str
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    dtype: Optional[str] = None


@dataclass(frozen=True)
class Entry:
    """One source region -> one destination region (the attributes of AOAEngine's ShardMappingEntry)."""

    source_slice: Desc
    target_slice: Desc
    postprocess_list: Tuple[str, ...] = ("[1, 0]",)


def _transposed_pieces(name: str, entries, key: str, in_features: int) -> List[Tuple[int, int, int]]:
    """(column offset, columns, destination row) of each piece of ``key`` in destination ``name``."""
    pieces = []
    for e in entries:
        perms, _ = permutations_and_cast(e.postprocess_list)
        src, dst = e.source_slice, e.target_slice
        if perms != [[1, 0]] or len(src.global_offset) != 2:
            raise LoraError(f"{name!r} is not a transpose of {key!r} (postprocess {list(e.postprocess_list or [])}): "
                            "its PEFT adapter cannot be derived")
        if src.global_offset[0] != 0 or src.local_shape[0] != in_features or dst.global_offset[1] != 0:
            raise LoraError(f"{name!r} takes part of the input rows of {key!r}: its PEFT adapter cannot be derived")
        pieces.append((int(src.global_offset[1]), int(src.local_shape[1]), int(dst.global_offset[0])))
    return pieces


def adapter_map(dmap: DestinationMap, shard_info: Dict[str, list], layers: Sequence) -> DestinationMap:
    """The adapter's destinations and their source regions, from the snapshot's ``dmap``.

    ``shard_info``: the adapter's sources (``lora_A`` / ``lora_B`` keys -> [desc]) as every rank of the
    mesh holds them; their global shapes and dtypes are read from it. ``layers`` are the LoRA layers
    this rank knows; a pipeline stage knows only its own, so the other stages' are the pairs
    ``<layer>.lora_A`` / ``<layer>.lora_B`` of ``shard_info`` (over the weight ``<layer>.weight``)."""
    by_weight = {lay.weight_key: (lay.a_key, lay.b_key) for lay in layers}
    for key in shard_info:
        layer = key[: -len(".lora_A")]
        if key.endswith(".lora_A") and layer + ".lora_B" in shard_info:
            by_weight.setdefault(layer + ".weight", (key, layer + ".lora_B"))
    specs, entries = [], {}
    for name in sorted(dmap.entries, key=natural_key):
        es = dmap.entries[name]
        keys = sorted({e.source_slice.key for e in es})
        lora = [k for k in keys if k in by_weight]
        if not lora:
            continue
        if len(keys) > 1:
            raise LoraError(
                f"{name!r} is made of {keys}, {len(lora)} of them with LoRA: peft has one LoRA module per weight, so "
                "this layout has no PEFT adapter (the merged snapshot is unaffected); set export.peft_adapter=none")
        if not name.endswith(".weight"):
            raise LoraError(f"{name!r}: a LoRA weight must be exported as '<module>.weight' for a PEFT adapter")
        a_key, b_key = by_weight[lora[0]]
        a_info, b_info = shard_info[a_key][0], shard_info[b_key][0]
        in_features, r = (int(d) for d in a_info.global_shape)
        out_d = int(dmap.spec_by_name[name].shape[0])
        pieces = _transposed_pieces(name, es, lora[0], in_features)
        module = PREFIX + name[: -len(".weight")]
        a_name, b_name = module + ".lora_A.weight", module + ".lora_B.weight"
        specs += [TensorSpec(a_name, (r, in_features), a_info.dtype), TensorSpec(b_name, (out_d, r), b_info.dtype)]
        a_glob = (in_features, r)
        entries[a_name] = [Entry(Desc(a_key, a_glob, a_glob, (0, 0), a_info.dtype),
                                 Desc(a_name, (r, in_features), (r, in_features), (0, 0)))]
        b_glob = tuple(int(d) for d in b_info.global_shape)
        entries[b_name] = [Entry(Desc(b_key, (r, cols), b_glob, (0, col), b_info.dtype),
                                 Desc(b_name, (cols, r), (out_d, r), (row, 0))) for col, cols, row in pieces]
    if not specs:
        raise LoraError("no exported weight comes from a LoRA layer: there is no PEFT adapter to write")
    return DestinationMap(specs, entries, None)


def peft_scaling(r: int, alpha, rslora: bool) -> float:
    """peft's ``scaling`` for ``r``, ``lora_alpha`` and ``use_rslora`` (the same Python arithmetic as
    Paddle's layers, so the float is the same)."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def adapter_settings(layers: Sequence) -> Tuple[int, Any, bool]:
    """(r, lora_alpha, use_rslora) shared by every layer; a LoraError where peft could not reproduce a
    layer's scaling."""
    pissa = [lay.name for lay in layers if lay.pissa]
    if pissa:
        raise LoraError(f"PiSSA layers ({pissa[0]!r}, ...): their adapter applies to the residual base W - A0 @ B0, "
                        "not to the base model, and the snapshot holds neither; set export.peft_adapter=none")
    settings = set()
    for lay in layers:
        for rslora in (False, True):
            if peft_scaling(lay.r, lay.alpha, rslora) == lay.scaling:
                settings.add((lay.r, lay.alpha, rslora))
                break
        else:
            raise LoraError(f"LoRA layer {lay.name!r}: scaling {lay.scaling} is neither lora_alpha/r nor "
                            f"lora_alpha/sqrt(r) (r={lay.r}, lora_alpha={lay.alpha}): peft could not reproduce it")
    if len(settings) != 1:
        raise LoraError(f"the LoRA layers differ in (r, lora_alpha, rslora): {sorted(settings, key=str)}; "
                        "one PEFT adapter config cannot describe them")
    return settings.pop()


def target_modules(dmap: DestinationMap, adapter: DestinationMap) -> List[str]:
    """peft's ``target_modules``: a leaf name (``q_proj``) where every 2-D weight of that name has LoRA,
    else the full module names."""
    mods = {n[len(PREFIX):-len(".lora_A.weight")] for n in adapter.entries if n.endswith(".lora_A.weight")}
    weights = {n[: -len(".weight")] for n, spec in dmap.spec_by_name.items()
               if n.endswith(".weight") and len(spec.shape) == 2}
    out = set()
    for leaf in {m.rsplit(".", 1)[-1] for m in mods}:
        same = {w for w in weights if w.rsplit(".", 1)[-1] == leaf}
        out |= {leaf} if same <= mods else {m for m in mods if m.rsplit(".", 1)[-1] == leaf}
    return sorted(out, key=natural_key)


def adapter_config(settings: Tuple[int, Any, bool], targets: List[str], base_model: Optional[str] = None) -> dict:
    """``adapter_config.json`` for HF peft (LoRA, causal LM, no dropout or bias at inference)."""
    r, alpha, rslora = settings
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base_model, "rank_pattern": {}, "alpha_pattern": {},
    }


def companion(layers: Sequence, base_model: Optional[str] = None, sharded_state_dict=None, tensors=None,
              config: Optional[dict] = None):
    """The adapter as a companion of the snapshot (``<snapshot>/adapter/``), from a live model's slices
    (``sharded_state_dict``) or from files (``tensors``); refused now where peft cannot follow.
    ``config``: the run's LoRA config, for a pipeline stage that holds no LoRA layer."""
    from ...export.source import Companion

    if layers:
        settings = adapter_settings(layers)
    elif config and "r" in config and "lora_alpha" in config:
        settings = (config["r"], config["lora_alpha"], bool(config.get("rslora")))
    else:
        raise LoraError("this rank holds no LoRA layer and the model no LoRA config: the adapter's r and "
                        "lora_alpha are unknown here; set export.peft_adapter=none")
    return Companion(
        directory=DIRECTORY, file_prefix=FILE_PREFIX,
        destinations=lambda dmap, shard_info: adapter_map(dmap, shard_info, layers),
        sharded_state_dict=sharded_state_dict, tensors=tensors,
        json_files={CONFIG_FILE: lambda dmap, adapter: adapter_config(settings, target_modules(dmap, adapter), base_model)})


__all__ = ["CONFIG_FILE", "companion", "DIRECTORY", "FILE_PREFIX", "PREFIX", "adapter_config", "adapter_map", "adapter_settings",
           "peft_scaling", "target_modules"]
