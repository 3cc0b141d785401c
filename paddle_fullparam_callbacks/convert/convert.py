"""``paddle-fullparam convert``: a Hugging Face snapshot from a trainer checkpoint already on disk.

The offline path: ``checkpoints/`` index the files, ``prepare`` builds the model lazily, checks the
checkpoint against it and wraps the files as the export's tensor source, ``workers`` splits the
files over processes. The export itself is the callback's own (``export.ExportSession``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

from ..config.recipes import coerce_config
from ..config.schema import FullParamConfig
from ..export.source import SnapshotInfo
from .prepare import ConvertError, export_conversion, prepare


def _check_output_dir(output_dir: Path, checkpoint: Path) -> None:
    out, ckpt = output_dir.resolve(), checkpoint.resolve()
    if out == ckpt:
        raise ConvertError(f"--output-dir {output_dir} is the checkpoint directory itself: give another directory")


def convert(checkpoint_dir: "str | os.PathLike", output_dir: "str | os.PathLike",
            config: "FullParamConfig | str | dict | None" = None, overrides: Iterable[str] = (),
            model_config: "str | os.PathLike | dict | None" = None, step: Optional[int] = None,
            workers: int = 1, base: "str | os.PathLike | None" = None,
            lora_config: "str | os.PathLike | dict | None" = None, as_base: bool = False) -> SnapshotInfo:
    """Write an HF snapshot of the trainer checkpoint ``checkpoint_dir`` into ``output_dir`` (named by
    ``export.name_template`` at the checkpoint's step, committed atomically, pointed at by ``latest``).

    Args:
        config: the package's config (a recipe name or path, a dict of recipe keys, or a config object);
            only ``export.*`` and ``retention.*`` matter here. ``overrides``: ``key=value`` on top of it.
        model_config: the model's config.json (or its directory, or a dict) when the checkpoint has none.
        step: the step to record, when the checkpoint does not say.
        workers: processes that write the snapshot's files in parallel (each reads only what its files hold).
        base: a LoRA run's checkpoint of LoRA tensors only (PaddleNLP's ``lora_model_state.pdparams``): the base
            model the run started from (its directory or a checkpoint of it).
        lora_config: a LoRA run's ``lora_config.json`` (or its directory, or a dict), where the checkpoint holds
            none (PaddleFormers' flex checkpoints): ``lora_alpha`` and ``rslora`` give the merge's scaling.
        as_base: write the base model a serving engine starts on for a LoRA run served as adapters
            (``serve.adapter``): a LoRA checkpoint's base weights without their update (``export.lora=base``, no
            adapter), at step 0 when none is recorded (a model saved in Paddle's format, e.g. PaddleNLP's
            ``save_pretrained``).

    Raises:
        CheckpointError: the checkpoint is damaged, incomplete or does not match its config (nothing written).
        ConfigError / MappingError: a bad option or mapping (nothing written).
        ExportError: the export itself failed (nothing committed).
    """
    cfg = coerce_config(config, overrides)
    if as_base:  # the weights the run starts from, which the engine keeps while it loads each adapter
        cfg.export.lora, cfg.export.peft_adapter = "base", "none"
    default_step = 0 if as_base else None
    lora = {k: v for k, v in (("base", base), ("lora_config", lora_config)) if v is not None}
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    out = Path(output_dir).expanduser()
    _check_output_dir(out, Path(checkpoint_dir).expanduser())
    if workers > 1:
        from .workers import convert_in_workers  # spawns processes: imported only when asked for

        return convert_in_workers(checkpoint_dir, out, cfg, model_config, step, workers, lora, default_step)
    conv = prepare(checkpoint_dir, cfg, model_config, step, **lora, default_step=default_step)
    return export_conversion(conv, out, cfg)
