"""A live LoRA model as an export source: base keys only, each LoRA weight merged when it is read.

``LoraExport`` splits the model's sharded state dict in two: the base tensors (what the mapping,
the plans and the assemblers see) and the ``lora_A`` / ``lora_B`` tensors (read only by the merge
and by the PEFT adapter). For ``export.lora: merge`` each LoRA weight's key gets a transform that
the assembler applies to this rank's block of ``W`` just before it is used: that block merged with
the rank's own rows of ``A`` and columns of ``B`` (``merge.py``), dropped once written or sent. A
layer that is merged already, disabled, or a PiSSA layer before its first forward exports ``W`` as
it is. The layers' state is read at every export, never cached.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Dict, List, Optional

import numpy as np

from ...assemble.device import host_array
from ...assemble.mapping import dtype_name
from ...export.source import Companion
from . import adapter as peft
from .layers import LoraError, LoraLayer, attach_keys, describe, find_lora_layers, lora_config_of
from .merge import MergedArray

logger = logging.getLogger("paddle_fullparam_callbacks")


def merge_transform(lay: LoraLayer) -> Callable:
    """fn(this rank's block of the layer's weight as a host array, its dtype) -> the block to export in
    the same dtype (merged if the layer is active): a lazy array (``MergedArray``: the product now, the
    rest block by block on the writer's worker threads; merged in float32, cast once with Paddle's
    bits). The LoRA factors come to the host through the device boundary; the merge runs on the host,
    so a job on an accelerator merges with the same bits as the CPU tests (and peft), and spends no
    device memory on it."""

    def merged(weight: np.ndarray, w_dtype: str):
        if lay.state() != "active":
            return weight
        layer = lay.layer
        a, b = layer.lora_A, layer.lora_B
        try:
            return MergedArray(weight, w_dtype, host_array(a), dtype_name(a), host_array(b), dtype_name(b),
                               layer.scaling)
        except ValueError as e:
            raise LoraError(f"LoRA layer {lay.name!r} ({lay.weight_key}): {e}") from e

    return merged


class LoraExport:
    """The LoRA side of one model's export (``mode``: ``merge`` or ``base``)."""

    def __init__(self, model, read: Callable[[], dict], mode: str, notes: dict, framework: str):
        self.layers: List[LoraLayer] = find_lora_layers(model)
        self.read, self.mode, self.notes, self.framework = read, mode, notes, framework
        self.config = lora_config_of(model)
        attach_keys(self.layers, read())
        self.lora_keys = {k for lay in self.layers for k in (lay.a_key, lay.b_key)}
        self.by_weight: Dict[str, LoraLayer] = {lay.weight_key: lay for lay in self.layers}

    def main_state_dict(self) -> dict:
        """The base tensors of this rank (no lora_A / lora_B); the manifest notes refreshed."""
        sd = self.read()
        states = Counter(lay.state() for lay in self.layers)
        if self.mode == "base" and states.get("merged"):
            merged = next(lay.name for lay in self.layers if lay.state() == "merged")
            raise LoraError(f"export.lora=base: LoRA layer {merged!r} is merged into its weight (PaddleFormers' merge(), "
                            "PaddleNLP's merge_weights after model.eval()): the model no longer holds its base weights")
        self.notes["lora"] = self.describe(states)
        return {k: v for k, v in sd.items() if k not in self.lora_keys}

    def lora_state_dict(self) -> dict:
        sd = self.read()
        return {k: sd[k] for k in sorted(self.lora_keys) if k in sd}

    def transforms(self) -> Dict[str, Callable]:
        if self.mode != "merge":
            return {}
        return {key: merge_transform(lay) for key, lay in self.by_weight.items()}

    def describe(self, states: Optional[Counter] = None) -> dict:
        """The manifest's ``model.lora``: what was merged, with which r, alpha and scaling."""
        states = states if states is not None else Counter(lay.state() for lay in self.layers)
        return describe(self.layers, states, self.config, self.framework, self.mode)

    def adapter(self) -> Companion:
        """The PEFT adapter as a companion of the snapshot (``<snapshot>/adapter/``)."""
        return peft.companion(self.layers, self.config.get("base_model_name_or_path"),
                              sharded_state_dict=self.lora_state_dict, config=self.config)


__all__ = ["LoraExport", "merge_transform"]
