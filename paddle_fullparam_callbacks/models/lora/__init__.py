"""LoRA models (PaddleFormers' and PaddleNLP's ``LoRAModel``): merged snapshots and PEFT adapters.

``layers`` finds the LoRA layers and reads their state, ``merge`` is the arithmetic of one merged
block, ``live`` turns a live LoRA model into the parts of an export source (base keys only, a merge
per LoRA weight applied by the assemblers, the adapter as a companion), ``adapter`` derives the
PEFT adapter from the snapshot's own name mapping, ``files`` merges LoRA checkpoints on disk
(``convert``). docs/models.md ("LoRA") describes the choices.
"""
from __future__ import annotations

from typing import Callable

from .layers import LoraError, find_lora_layers, is_lora_wrapper


def base_model(model):
    """The base model of a framework ``LoRAModel``; any other model as it is."""
    return model.model if is_lora_wrapper(model) else model


def has_lora(model) -> bool:
    """Whether ``model`` (a ``LoRAModel`` or a base model) holds LoRA layers."""
    model = base_model(model)
    return any("LoRA" in type(layer).__name__ and ".peft" in type(layer).__module__ for layer in model.sublayers())


def lora_export(model, read: Callable[[], dict], config, framework: str):
    """A :class:`~.live.LoraExport` for ``model`` (the wrapper or its base), or None without LoRA layers.

    ``read``: the base model's sharded state dict (LoRA tensors included); ``config``: the package's."""
    if not has_lora(model):
        return None
    from .live import LoraExport

    return LoraExport(model, read, config.export.lora, {}, framework)


def attach_to_source(lora, source, config) -> None:
    """Give ``source`` (a ModelSource of the base keys) the merge transforms, the adapter and the notes."""
    lora.notes = source.notes
    source.local_transforms = lora.transforms()
    if config.export.peft_adapter == "inside":
        source.companions = [lora.adapter()]
    source.notes["lora"] = lora.describe()


__all__ = ["LoraError", "attach_to_source", "base_model", "find_lora_layers", "has_lora", "is_lora_wrapper",
           "lora_export"]
