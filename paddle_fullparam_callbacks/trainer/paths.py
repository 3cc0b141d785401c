"""Snapshots never land on the trainer's own files.

The trainer owns ``<args.output_dir>/checkpoint-N/`` (optimizer, master weights, trainer state)
and rotates them itself. A configuration whose snapshots could take such a name, or whose
``output_dir`` lies inside one of them, is refused at start with an error naming the key (the
checkpoint hook writes *into* ``checkpoint-N/<subdir>`` on purpose, through its own path).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..config.schema import ConfigError, FullParamConfig
from ..plan.naming import format_snapshot_name

_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


def check_trainer_paths(config: FullParamConfig, output_dir: Path, trainer_output_dir: Optional[str]) -> None:
    if not trainer_output_dir:
        return
    trainer = Path(trainer_output_dir).expanduser().resolve()
    out = Path(output_dir).expanduser().resolve()
    if out == trainer:
        for step in (0, 1, 500, 123456):
            name = format_snapshot_name(config.export.name_template, step)
            if _CHECKPOINT.match(name):
                raise ConfigError(
                    "export.name_template",
                    f"gives {name!r} in the trainer's output_dir {str(trainer)!r}: that is the name of the trainer's own "
                    "checkpoint (optimizer, master weights, trainer state), which a snapshot would replace. Use another "
                    "template (the default is hf-step-{step:06d}) or another output_dir")
    try:
        inside = out.relative_to(trainer).parts
    except ValueError:
        return
    if inside and _CHECKPOINT.match(inside[0]):
        raise ConfigError(
            "output_dir",
            f"{str(out)!r} is inside the trainer's checkpoint {inside[0]!r}, which the trainer rotates and resumes from; "
            "to keep a snapshot with each checkpoint use checkpoint_hook.enabled with attach()")
