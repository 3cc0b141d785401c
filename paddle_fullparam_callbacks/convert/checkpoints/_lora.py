"""LoRA tensors of PaddleNLP 2.8 checkpoints: ``lora_model_state.pdparams`` (the trainable tensors only).

PaddleNLP's Trainer saves a LoRA run's checkpoint as ``lora_model_state.pdparams`` (``lora_A`` /
``lora_B`` of every LoRA layer, under the base model's names, Paddle layout), ``lora_config.json``
and the base model's ``config.json``; never the base weights. A tensor-parallel run saves each
rank's local tensors (``lora_model_state.tp00.pdparams``, ...), which are not read here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

from ._base import CheckpointError, TensorInfo
from ._pdparams import _dtype, _index, _whole

_FILE = re.compile(r"^lora_model_state(?:\.([A-Za-z0-9_]+))?\.pdparams$")
CONFIG = "lora_config.json"


def lora_pdparams_files(path: Path) -> List[Path]:
    return sorted(p for p in Path(path).iterdir() if p.is_file() and _FILE.match(p.name))


def open_lora_pdparams(path: Path, config: Optional[dict] = None) -> Dict[str, TensorInfo]:
    """The LoRA tensors of a PaddleNLP checkpoint, indexed (nothing loaded)."""
    files = lora_pdparams_files(path)
    if not files:
        raise CheckpointError(f"{path}: holds no lora_model_state*.pdparams")
    if len(files) > 1 or _FILE.match(files[0].name).group(1):
        raise CheckpointError(
            f"{path}: {', '.join(f.name for f in files)} are one tensor-parallel rank's LoRA tensors each, which "
            "convert does not join: save the LoRA model with save_pretrained(..., merge_tensor_parallel=True) "
            "(one lora_model_state.pdparams), or export it live with the callback")
    out = {}
    for key, ref in _index(files[0]).items():
        out[key] = TensorInfo(tuple(ref.shape), _dtype(ref, config, f"{files[0].name}: tensor {key!r}"),
                              [_whole(files[0], ref)])
    if not out:
        raise CheckpointError(f"{files[0]}: holds no tensors")
    return out
