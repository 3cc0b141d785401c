"""What a conversion needs before and for its export: the model config, the lazily built model,
the checks of the checkpoint against it, the tensor source over the files, and the export.

The checkpoint is indexed without loading it (``checkpoints/``); the model class named by its
config is built under ``paddle.LazyGuard`` (no weights are allocated), only to give what the
callback takes from a live model: the parameter names and global shapes to check the checkpoint
against, the name mapping (``export.aoa``, chosen as the callback chooses it), ``config.json``
and the padding row. The tensors come from the files (``ModelSource.tensors``); planning,
writing, manifest and commit are the callback's own (``ExportSession``), so the snapshot is the
one the callback would have written at that step.

Everything that can be checked is checked before anything is written: the checkpoint's files
against its index, its tensors against the model of its config, the mapping, the output
directory. ``workers > 1`` splits the files over processes (``workers.py``); ``convert.py`` is the
entry point.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from .. import _dtypes
from ..config.schema import FullParamConfig
from ..export.source import ExportError, ModelSource, SnapshotInfo
from ..models import tokenizer as tokenizers
from ..models.tokenizer import TokenizerFiles
from . import described
from .checkpoints import Checkpoint, CheckpointError, detect, open_checkpoint, region
from .checkpoints._trainer_files import read_json

logger = logging.getLogger("paddle_fullparam_callbacks")

class ConvertError(CheckpointError):
    """The checkpoint cannot be converted as asked; nothing was written."""


def load_model_config(checkpoint: Path, config: "str | os.PathLike | dict | None") -> dict:
    """The model's config: ``config`` (a dict, a config.json, or a directory holding one) wins over the
    checkpoint's own ``config.json``. PaddleFormers' flex checkpoints carry none."""
    if isinstance(config, dict):
        return dict(config)
    if config is not None:
        path = Path(config).expanduser()
        path = path / "config.json" if path.is_dir() else path
        obj = read_json(path)
        if obj is None:
            raise ConvertError(f"--config {config}: no such file (give the model's config.json or its directory)")
        return obj
    own = read_json(checkpoint / "config.json")
    if own is None:
        raise ConvertError(
            f"{checkpoint}: holds no config.json (PaddleFormers' flex checkpoints never do): give the model's config "
            "with --config (the config.json of the model the job started from, or of its output directory)")
    return own


def model_class(framework: str, cfg: dict):
    """The single-process causal-LM class config.json's ``architectures`` names (a ``*Pipe`` class's plain one)."""
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ConvertError(f"the model config has no \"architectures\" (e.g. [\"LlamaForCausalLM\"]): cannot tell which "
                           f"{framework} class the checkpoint belongs to; add it to the config")
    import importlib

    namespace = importlib.import_module(f"{framework}.transformers")
    name = archs[0]
    for candidate in (name, name[:-len("Pipe")] if name.endswith("Pipe") else None,
                      name.replace("PipeDeprecated", "Deprecated") if "PipeDeprecated" in name else None):
        cls = getattr(namespace, candidate, None) if candidate else None
        if isinstance(cls, type) and hasattr(cls, "config_class") and not candidate.endswith("Pipe"):
            return cls
    raise ConvertError(f"the model config names architecture {name!r}, which {framework}.transformers does not have "
                       "(or only as a pipeline class without its plain counterpart)")


def build_lazy_model(cls, cfg: dict):
    """The model as one process would build it, with no weights allocated (``paddle.LazyGuard``)."""
    import paddle

    from ..models.model_info import _PARALLEL_KEY

    fields = {k: v for k, v in cfg.items() if not k.startswith("_") and not _PARALLEL_KEY.match(k)}
    try:
        config = cls.config_class.from_dict(fields)
        config = config[0] if isinstance(config, tuple) else config
        with paddle.LazyGuard():
            model = cls(config)
    except Exception as e:
        raise ConvertError(f"cannot build {cls.__name__} from the model config: {type(e).__name__}: {e}") from e
    return model


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(v)) for v in shape) + "]"


def check_against_model(ckpt: Checkpoint, expected: Dict[str, tuple], cls_name: str) -> None:
    """The checkpoint holds exactly the model's parameters, each with the model's global shape."""
    have = set(ckpt.tensors)
    missing = sorted(set(expected) - have)
    extra = sorted(have - set(expected))
    wrong = sorted(k for k in set(expected) & have if tuple(ckpt.tensors[k].global_shape) != tuple(expected[k]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) of {cls_name} missing from the checkpoint, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) that {cls_name} does not have, e.g. {extra[:3]}")
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} tensor(s) with another shape than the model's, e.g. {k!r}: checkpoint "
                        f"{_fmt(ckpt.tensors[k].global_shape)}, model {_fmt(expected[k])}")
    if problems:
        raise ConvertError(f"{ckpt.path}: does not match the model its config describes: {'; '.join(problems)} "
                           "(is the config the one this checkpoint was trained with?)")


class CheckpointTensors:
    """The checkpoint as an export source (``export.source.TensorSource``): one record per tensor
    (its whole global shape); ``read`` gives any region of it as a lazy array whose bytes go from the
    files straight into the writer's buffers when it fills them (``checkpoints/_reads.py``)."""

    def __init__(self, ckpt: Checkpoint, keys: Iterable[str]):
        from ..assemble.mesh import ShardRecord

        self.ckpt = ckpt
        self._records = [ShardRecord(0, k, (0,) * len(ckpt.tensors[k].global_shape), tuple(ckpt.tensors[k].global_shape),
                                     tuple(ckpt.tensors[k].global_shape), ckpt.tensors[k].dtype) for k in sorted(keys)]

    def records(self) -> List:
        return list(self._records)

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]):
        return region(self.ckpt, key, offset, shape)

    def describe(self) -> dict:
        c = self.ckpt
        parallel = {k: v for k, v in c.parallel.items() if v > 1}
        return {"checkpoint": str(c.path), "framework": c.framework, "layout": c.layout, "step": c.step,
                "parallel": parallel}


@dataclass
class Conversion:
    """A checked checkpoint, ready to export: its index, the model built from its config, the source."""

    checkpoint: Checkpoint
    model: object
    source: ModelSource
    step: int
    lora_checkpoint: Optional[Checkpoint] = None  # the LoRA tensors' own checkpoint (PaddleNLP's), if apart
    # (key, description) of a model built here, kept once its export succeeded (described.py); None if it came from there
    description: Optional[tuple] = None


def prepare(checkpoint_dir: "str | os.PathLike", config: FullParamConfig,
            model_config: "str | os.PathLike | dict | None" = None, step: Optional[int] = None,
            base: "str | os.PathLike | None" = None, lora_config: "str | os.PathLike | dict | None" = None,
            default_step: Optional[int] = None) -> Conversion:
    """Index and check the checkpoint, build its model lazily, and resolve the mapping: every check that
    does not need the output directory. Raises :class:`CheckpointError` / ``ConfigError`` / ``MappingError``.

    A LoRA run's checkpoint (``lora.py``): ``base``, the base model of a checkpoint that holds LoRA tensors
    only (PaddleNLP); ``lora_config``, the run's ``lora_config.json`` where the checkpoint has none.
    ``default_step``: the step when neither ``step`` nor the checkpoint gives one (a saved model: 0)."""
    from ..models.model_info import build_model_source
    from . import lora

    path = Path(checkpoint_dir).expanduser()
    if not path.is_dir():
        raise ConvertError(f"{path}: not a directory (give a trainer checkpoint directory, e.g. output/checkpoint-500)")
    weights, lora_ckpt = path, None  # where the base weights are; the checkpoint of LoRA tensors only
    if lora.lora_only(path):
        if base is None:
            raise ConvertError(f"{path}: holds LoRA tensors only (lora_model_state.pdparams), no base weights: give the "
                               "base model the run started from with --base PATH (its directory or a checkpoint of it)")
        weights, lora_ckpt = Path(base).expanduser(), lora.lora_checkpoint(path, "paddlenlp")
    elif base is not None:
        raise ConvertError(f"--base {base}: {path} holds its own base weights; --base is for checkpoints of LoRA "
                           "tensors only (PaddleNLP's lora_model_state.pdparams)")
    cfg = load_model_config(weights, model_config)
    layout, framework = detect(weights)
    # the model's description kept by an earlier conversion with the same inputs (described.py): no model class
    key = described.key(framework, cfg, dataclasses.asdict(config.export)) if layout != "pdparams" else None
    desc = described.load(key) if key else None
    cls = model_class(framework, cfg) if desc is None else None
    ckpt = open_checkpoint(weights, config=cfg, model_class=cls)
    base_shapes, holder, layers = lora.split_lora(ckpt, lora_ckpt, lora.load_settings(path, lora_config))
    if layers or lora_ckpt is not None:
        ckpt = replace(ckpt, tensors={k: ckpt.tensors[k] for k in base_shapes})
    if ckpt.layout == "hf-safetensors":
        raise ConvertError(
            f"{path}: already holds Hugging Face names and layout (PaddleFormers' unified_checkpoint / sharding_io "
            "save): it loads in transformers as it is; convert reads flex checkpoints (PaddleFormers' default)")
    # every layout holds global tensors as one process's model names and lays them out (PaddleNLP's
    # merged its ranks' pieces; PaddleFormers' flex metadata places them): the model is built for one process
    model = build_lazy_model(cls, cfg) if desc is None else None
    expected = desc.expected if desc is not None else {k: tuple(sw.global_shape)
                                                       for k, sw in model.sharded_state_dict().items()}
    check_against_model(ckpt, expected, desc.class_name if desc is not None else cls.__name__)
    files = (lora_ckpt.tokenizer_files if lora_ckpt is not None else []) or ckpt.tokenizer_files
    saved = TokenizerFiles(files, str((lora_ckpt or ckpt).path)) if files else None
    if desc is None:
        source = build_model_source(model, config, saved, warn_no_tokenizer=config.export.copy_tokenizer)
        fresh = described.describe(source, cls.__name__, expected) if key else None
    else:
        source = desc.source(tokenizers.choose(config.export.tokenizer, saved, config.export.copy_tokenizer))
        fresh = None
    if ckpt.parallel.get("tensor_parallel_degree", 1) > 1 or ckpt.parallel.get("pipeline_parallel_degree", 1) > 1:
        # the job's input embedding was not the one-process class's: a vocab-parallel embedding (tensor
        # parallel) or a pipeline's embedding stage has no padding index (PaddleFormers' Embedding.create
        # drops it), so the job's forward returned the stored row for the pad id, and so does the snapshot
        source.padding_rows.clear()
    source.tensors = CheckpointTensors(ckpt, expected)
    source.notes["converted_from"] = source.tensors.describe()
    if layers:
        lora.attach(source, config, holder, layers, lora.load_settings(path, lora_config), framework, CheckpointTensors)
    step = (lora_ckpt or ckpt).step if step is None else step
    step = default_step if step is None else step
    if step is None or step < 0:
        raise ConvertError(f"{path}: no step recorded (trainer_state, checkpoint-N name): give one with --step")
    return Conversion(ckpt, model, source, int(step), lora_ckpt, (key, fresh) if fresh is not None else None)


def export_conversion(conv: Conversion, output_dir: Path, config: FullParamConfig, ctx=None) -> SnapshotInfo:
    """The export itself (one process, or one worker of several: ``ctx``)."""
    import copy

    from ..export.session.session import ExportSession

    # tensors read but not yet written are this process's only extra memory: at most a tenth of the model
    # (and never more than export.max_pending_bytes), besides the tensor in hand
    config = copy.deepcopy(config)
    model_bytes = sum(math.prod(t.global_shape) * _dtypes.lookup(t.dtype).itemsize
                      for t in conv.checkpoint.tensors.values())
    config.export.max_pending_bytes = str(max(1, min(config.export.max_pending, model_bytes // 10)))
    session = ExportSession(config, output_dir, ctx=ctx)
    session.start()
    try:
        info = session.export(conv.source, conv.step, reason="convert")
    except ExportError as e:
        # a file that changed after it was indexed is the checkpoint's fault, not the export's: said as such
        # (nothing was committed: the export removed what it had written)
        met = [x for c in (conv.checkpoint, conv.lora_checkpoint) if c is not None for x in c.read_errors]
        if met:
            raise met[0] from e
        raise
    finally:
        session.close()
    if conv.description is not None:  # the export checked the mapping and wrote the snapshot: worth keeping
        described.save(*conv.description)
    if session.ctx.is_coordinator:
        logger.info("converted %s (%s, %s) -> %s", conv.checkpoint.path, conv.checkpoint.framework,
                    conv.checkpoint.layout, info.path)
    return info


__all__ = ["CheckpointError", "ConvertError", "export_conversion", "prepare"]
