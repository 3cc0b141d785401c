"""``convert`` of a LoRA run's checkpoint: the merged snapshot (and the PEFT adapter) of that step.

Two layouts are read (docs/convert.md, "LoRA checkpoints"):

* PaddleFormers flex checkpoints hold the base weights and every ``lora_A`` / ``lora_B`` side by side,
  but not the run's ``lora_alpha`` / ``rslora``: a ``lora_config.json`` (``LoRAModel.save_pretrained``
  writes one; ``--lora-config``) gives them;
* PaddleNLP checkpoints hold ``lora_model_state.pdparams`` and ``lora_config.json`` without the base
  weights: ``--base`` names the base model (a directory ``save_pretrained`` wrote, or a checkpoint).

The LoRA tensors never reach the mapping: the export reads the base weights through
``models.lora.files.MergedTensors`` (merged region by region) and writes the adapter as a companion.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..models.lora.files import StoredLora, is_lora_key, lora_settings, stored_layers
from .checkpoints import Checkpoint, CheckpointError
from .checkpoints._lora import CONFIG, lora_pdparams_files, open_lora_pdparams
from .checkpoints._trainer_files import read_json, read_step, tokenizer_files


def lora_only(path: Path) -> bool:
    """A checkpoint of LoRA tensors without base weights (PaddleNLP's ``lora_model_state*.pdparams``)."""
    from .checkpoints import detect

    if not lora_pdparams_files(path):
        return False
    try:
        detect(path)
    except CheckpointError:
        return True  # no base weights in it
    return False


def load_settings(path: Path, option: "str | os.PathLike | dict | None") -> Optional[dict]:
    """The run's LoRA config: ``option`` (a dict, a lora_config.json or its directory) wins over the
    checkpoint's own ``lora_config.json``; None when neither exists."""
    if isinstance(option, dict):
        return lora_settings(option, "--lora-config")
    if option is not None:
        f = Path(option).expanduser()
        f = f / CONFIG if f.is_dir() else f
        obj = read_json(f)
        if obj is None:
            raise CheckpointError(f"--lora-config {option}: no such file (give the run's {CONFIG} or its directory)")
        return lora_settings(obj, str(f))
    own = read_json(path / CONFIG)
    return lora_settings(own, str(path / CONFIG)) if own is not None else None


def lora_checkpoint(path: Path, framework: str) -> Checkpoint:
    """PaddleNLP's LoRA tensors of checkpoint ``path`` as a Checkpoint (its reader, its step)."""
    tensors = open_lora_pdparams(path)
    return Checkpoint(path=path, framework=framework, layout="pdparams", tensors=tensors, config=None, parallel={},
                      step=read_step(path), tokenizer_files=tokenizer_files(path))


def split_lora(ckpt: Checkpoint, lora_ckpt: Optional[Checkpoint], settings: Optional[dict],
               ) -> Tuple[Dict[str, tuple], Optional[Checkpoint], list]:
    """(the base tensors' shapes, the checkpoint that holds the LoRA tensors, the LoRA layers) of a
    checkpoint; ([...], None, []) when it holds no LoRA tensor."""
    base = {k: tuple(t.global_shape) for k, t in ckpt.tensors.items() if not is_lora_key(k)}
    holder = lora_ckpt if lora_ckpt is not None else ckpt
    lora = {k: tuple(t.global_shape) for k, t in holder.tensors.items() if is_lora_key(k)}
    if not lora:
        if lora_ckpt is not None:
            raise CheckpointError(f"{lora_ckpt.path}: its lora_model_state holds no lora_A / lora_B tensor")
        return base, None, []
    if settings is None:
        raise CheckpointError(
            f"{holder.path}: holds {len(lora)} LoRA tensors (e.g. {sorted(lora)[0]!r}) but no {CONFIG}, and the "
            f"run's lora_alpha and rslora are in no other file (PaddleFormers' checkpoints never save them): give "
            f"--lora-config (the {CONFIG} LoRAModel.save_pretrained writes, or a JSON file with lora_alpha and rslora)")
    layers = stored_layers(lora, base, settings)
    if any(lay.pissa for lay in layers) and lora_ckpt is not None:
        raise CheckpointError(
            f"{holder.path}: a PiSSA run (\"pissa\": true): its merged weights are the residual base W - A0 @ B0 "
            "plus A @ B, and the checkpoint holds no residual base (--base is the original model); export it live "
            "with the callback instead")
    return base, holder, layers


def attach(source, config, holder: Checkpoint, layers: list, settings: dict, framework: str, tensor_source) -> None:
    """Merge on read (``export.lora: merge``), the adapter (``export.peft_adapter``), the manifest notes."""
    from ..models.lora.adapter import companion
    from ..models.lora.files import MergedTensors
    from ..models.lora.layers import describe

    lora_tensors = tensor_source(holder, sorted(k for lay in layers for k in (lay.a_key, lay.b_key)))
    if config.export.lora == "merge":
        source.tensors = MergedTensors(source.tensors, lora_tensors, layers)
    if config.export.peft_adapter == "inside":
        source.companions = [companion(layers, settings.get("base_model_name_or_path"), tensors=lora_tensors)]
    source.notes["lora"] = describe(layers, {"active": len(layers)}, settings, framework, config.export.lora)
    if str(holder.path) != source.tensors.describe().get("checkpoint"):
        source.notes["lora"]["checkpoint"] = str(holder.path)


__all__ = ["StoredLora", "attach", "load_settings", "lora_checkpoint", "lora_only", "split_lora"]
