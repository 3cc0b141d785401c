"""Trainer checkpoints on disk (``checkpoint-N/``), indexed without the trainers and without loading them.

:func:`open_checkpoint` recognises the directory's format, checks it, and returns a :class:`Checkpoint`:
per model tensor its global shape, dtype and the file blocks that tile it. ``Checkpoint.read``
assembles any region of a tensor from memory-mapped blocks; :func:`region` is that region as a lazy
array whose bytes are read (``preadv``) straight into the buffers that consume it (``_reads.py``).

=====================  ===========================================================  =======================================
layout                 written by                                                   tensors
=====================  ===========================================================  =======================================
``flex``               PaddleFormers 1.2 default (``model_state/{uid}.metadata`` +  PaddleFormers names, Paddle ``[in, out]``;
                       ``{rank}_{uid}.distcp``), any dp/tp/pp                       a fused tensor-parallel weight is the
                                                                                    ranks' blocks side by side
``hf-safetensors``     PaddleFormers ``unified_checkpoint`` / ``sharding_io``       HF names, HF ``[out, in]``
                       (single process)
``pdparams``           PaddleNLP 2.8 (``model_state[.tpXX][_ppYY].pdparams``)        PaddleNLP names, Paddle layout, merged
                                                                                    as PaddleNLP merges them
``unified-safetensors``PaddleNLP 2.8 ``unified_checkpoint=True``                    PaddleNLP names, Paddle layout, merged
=====================  ===========================================================  =======================================

Only model weights are indexed (no optimizer state, master weights or RNG state). Every file a
checkpoint refers to is checked before anything is returned: present, complete, holding each tensor
with the shape and dtype the index says, the blocks of each tensor tiling it exactly.

>>> ckpt = open_checkpoint("out/checkpoint-2")  # doctest: +SKIP
>>> info = ckpt.tensors["model.norm.weight"]  # doctest: +SKIP
>>> ckpt.read("model.norm.weight", [0] * len(info.global_shape), info.global_shape)  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple

from ._base import Checkpoint, CheckpointError, FileSlice, TensorInfo, check_tiling
from ._flex import MODEL_STATE, metadata_files, open_flex
from ._pdparams import open_pdparams, pdparams_files
from ._reads import RegionRead, region
from ._safetensors import model_safetensors, open_safetensors
from ._trainer_files import framework_of, parallel_degrees, read_json, read_step, read_training_args, tokenizer_files

__all__ = ["Checkpoint", "CheckpointError", "FileSlice", "RegionRead", "TensorInfo", "detect", "open_checkpoint", "region"]

_EXPECTED = "expected model_state/*.metadata, model_state*.pdparams or model*.safetensors"


def open_checkpoint(path: "str | os.PathLike", config: Optional[dict] = None, model_class=None) -> Checkpoint:
    """Detect the format of a trainer checkpoint directory (``checkpoint-N/``) and index it without reading
    tensor bytes.

    Args:
        path: the checkpoint directory.
        config: the model's config as a dict, used when the directory has no ``config.json`` (PaddleFormers
            flex checkpoints never have one); the directory's own ``config.json`` wins otherwise.
        model_class: PaddleNLP tensor-parallel ``.pdparams`` only: the model class whose
            ``_get_tensor_parallel_mappings`` gives the merge rules (the class ``config.json``'s
            ``architectures`` names; for a ``*Pipe`` class its plain class).

    Raises:
        CheckpointError: not a checkpoint, an unsupported variant, or a damaged or inconsistent one; the
            message names the file or tensor and the cause.
    """
    path = Path(path).expanduser()
    try:
        return _open(path, config, model_class)
    except OSError as e:
        raise CheckpointError(f"{e.filename or path}: cannot be read: {e.strerror or e}") from e


def detect(path: "str | os.PathLike") -> Tuple[str, str]:
    """``(layout, framework)`` of checkpoint directory ``path`` from its files alone (no tensor read):
    which weights format it holds, and which trainer wrote it (needed before :func:`open_checkpoint`
    to pick the model class whose merge rules a tensor-parallel ``.pdparams`` checkpoint needs).

    Raises:
        CheckpointError: not a checkpoint directory, weights in several formats, or safetensors that
            neither config.json nor training_args.bin attribute to a trainer.
    """
    path = Path(path).expanduser()
    try:
        return _detect(path)[:2]
    except OSError as e:
        raise CheckpointError(f"{e.filename or path}: cannot be read: {e.strerror or e}") from e


def _detect(path: Path) -> Tuple[str, str, Optional[dict], dict]:
    """(layout, framework, config.json or None, training_args.bin's fields)"""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a trainer checkpoint is a checkpoint-N directory)")
    found = {"model_state/*.metadata (flex)": metadata_files(path / MODEL_STATE),
             "model_state*.pdparams": pdparams_files(path),
             "model*.safetensors": model_safetensors(path)}
    kinds = [k for k, v in found.items() if v]
    if not kinds:
        hint = (f" ({path.name}/ itself holds *.metadata: give the checkpoint directory that contains it)"
                if metadata_files(path) else "")
        raise CheckpointError(f"{path}: not a trainer checkpoint: {_EXPECTED}{hint}")
    if len(kinds) > 1:
        raise CheckpointError(f"{path}: holds model weights in several formats ({', '.join(kinds)}); "
                              "remove the ones that do not belong to this checkpoint")
    own_config, args = read_json(path / "config.json"), read_training_args(path)
    if found["model_state/*.metadata (flex)"]:
        return "flex", "paddleformers", own_config, args  # flex checkpoints exist only in PaddleFormers
    framework = framework_of(own_config, args)
    if found["model_state*.pdparams"]:
        return "pdparams", framework or "paddlenlp", own_config, args
    if framework is None:
        raise CheckpointError(f"{path}: cannot tell which trainer wrote model*.safetensors: config.json has no "
                              "paddleformers_version / paddlenlp_version and training_args.bin names neither")
    return ("hf-safetensors" if framework == "paddleformers" else "unified-safetensors"), framework, own_config, args


def _open(path: Path, config: Optional[dict], model_class) -> Checkpoint:
    layout, framework, own_config, args = _detect(path)
    cfg = own_config if own_config is not None else config
    parallel = parallel_degrees(args, own_config)
    if layout == "flex":
        tensors = open_flex(path)
    elif layout == "pdparams":
        tensors = open_pdparams(path, cfg, model_class, parallel)
    else:
        tensors = open_safetensors(path, cfg)
    if not tensors:
        raise CheckpointError(f"{path}: its {layout} index lists no model tensors")
    for key, info in tensors.items():
        check_tiling(key, info)
    return Checkpoint(path=path, framework=framework, layout=layout, tensors=tensors, config=cfg, parallel=parallel,
                      step=read_step(path), tokenizer_files=tokenizer_files(path))
