"""What a checkpoint directory says besides its weights: config.json, the step, the parallel degrees,
the tokenizer files. Read without the frameworks (training_args.bin and PaddleFormers'
trainer_state.bin are pickles: :func:`._pickles.load_records` reads them as inert records)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

from ...export.write.header import parse_json_strict
from ...models import tokenizer as models_tokenizer
from ._base import CheckpointError
from ._pickles import PickleFormatError, load_records, plain


def read_json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        obj = parse_json_strict(path.read_bytes())
    except ValueError as e:
        raise CheckpointError(f"{path.name}: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path.name}: not a JSON object")
    return obj


def read_training_args(path: Path) -> Dict[str, object]:
    """The fields of ``training_args.bin`` (enum members as their values), plus ``_class`` (module.name), or {}."""
    f = path / "training_args.bin"
    if not f.is_file():
        return {}
    try:
        rec = load_records(f)
    except PickleFormatError as e:
        raise CheckpointError(f"{f.name}: {e}") from e
    fields = getattr(rec, "__dict__", None)
    if not isinstance(fields, dict):
        raise CheckpointError(f"{f.name}: holds a {type(rec).__name__}, not TrainingArguments")
    out = {k: plain(v) for k, v in fields.items() if not k.startswith("_")}
    out["_class"] = getattr(type(rec), "_pickled_as", "")
    return out


def framework_of(config: Optional[dict], args: Dict[str, object]) -> Optional[str]:
    """"paddleformers" / "paddlenlp" from config.json's version key or the pickled TrainingArguments' module."""
    if config:
        if "paddleformers_version" in config:
            return "paddleformers"
        if "paddlenlp_version" in config:
            return "paddlenlp"
    cls = str(args.get("_class", ""))
    for name in ("paddleformers", "paddlenlp"):
        if cls.startswith(name + "."):
            return name
    return None


# canonical degree name -> the names the trainers' TrainingArguments and model configs use
_DEGREES = {
    "tensor_parallel_degree": ("tensor_model_parallel_size", "tensor_parallel_degree"),
    "pipeline_parallel_degree": ("pipeline_model_parallel_size", "pipeline_parallel_degree"),
    "sharding_parallel_degree": ("sharding_parallel_size", "sharding_parallel_degree"),
    "data_parallel_degree": ("data_parallel_size", "data_parallel_degree"),
    "sep_parallel_degree": ("sep_parallel_size", "sep_parallel_degree"),
    "context_parallel_degree": ("context_parallel_size", "context_parallel_degree"),
    "expert_parallel_degree": ("expert_model_parallel_size", "expert_parallel_degree"),
}


def parallel_degrees(args: Dict[str, object], config: Optional[dict]) -> Dict[str, int]:
    """The job's degrees under PaddleNLP's names (``tensor_parallel_degree``, ...): from training_args.bin,
    else from config.json; a trainer's -1 / 0 ("not set") counts as 1."""
    out = {}
    for canon, names in _DEGREES.items():
        for source in (args, config or {}):
            vals = [source.get(n) for n in names]
            v = next((x for x in vals if isinstance(x, int) and not isinstance(x, bool)), None)
            if v is not None:
                out[canon] = max(int(v), 1)
                break
    return out


_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def read_step(path: Path) -> Optional[int]:
    """``global_step`` of trainer_state.json (PaddleNLP) or trainer_state.bin (PaddleFormers), else the
    ``checkpoint-N`` directory name."""
    state = read_json(path / "trainer_state.json")
    if state is None and (path / "trainer_state.bin").is_file():
        try:
            state = getattr(load_records(path / "trainer_state.bin"), "__dict__", None)
        except PickleFormatError as e:
            raise CheckpointError(f"trainer_state.bin: {e}") from e
    step = plain((state or {}).get("global_step"))
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        return step
    m = _CHECKPOINT_DIR.match(path.name)
    return int(m.group(1)) if m else None


def tokenizer_files(path: Path) -> List[Path]:
    """The tokenizer files the trainer saved into the checkpoint (``tokenizer.save_pretrained``)."""
    return models_tokenizer.tokenizer_files(path)
