"""The one structured config of the package (omegaconf dataclasses); recipes are instances of it.

Every rule between fields is checked in ``__post_init__``, so a config built in Python and one
loaded from a recipe are validated the same way; each message names the recipe key.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import _dtypes
from ..plan.naming import snapshot_step_pattern, validate_template
from ..plan.quantization import DEFAULT_BLOCK, METHODS as QUANTIZATION_METHODS, check_block
from .consumers import EvaluateConfig, PublishConfig, ServeConfig
from .errors import ConfigError, check_choice as _check_choice
from .evaluating import lm_eval_against
from .publishing import check_against
from .serving import VERIFY_ALLOWANCE_S, swap_bound_s
from .sizes import AUTO, parse_size, pending_budget

EXPORT_FORMATS = ("hf_safetensors", "paddle_safetensors", "callable")
ASSEMBLERS = ("builtin", "paddle")
ON_ERROR = ("warn", "raise")
LORA_MODES = ("merge", "base")
PEFT_ADAPTER = ("none", "inside")


def _check_size(key: str, value: Any, allow_zero: bool = False, parse=parse_size) -> int:
    try:
        return parse(value, allow_zero)
    except ValueError as e:
        raise ConfigError(key, str(e)) from e


@dataclass
class TriggerConfig:
    """When a snapshot is taken. Several triggers on the same step make one snapshot."""

    every_n_steps: Optional[int] = None
    """Export every N optimizer steps (N >= 1); unset (null) turns this trigger off."""
    on_save: Optional[bool] = None
    """Export when the trainer saves a checkpoint. Unset (null): only when neither every_n_steps nor
    on_evaluate is set, so that a job that asks for every N steps gets exactly that cadence (with
    both, every trainer save would add a snapshot: steps 5, 6, 10, 12 for N=5 and saves every 6)."""
    on_evaluate: bool = False
    """Export after each evaluation."""
    on_train_end: bool = True
    """Export once when training ends (unless that step was just exported)."""
    min_interval_s: float = 0.0
    """Skip an export that would start sooner than this after the previous one (train_end never skips)."""

    @property
    def exports_on_save(self) -> bool:
        if self.on_save is None:
            return self.every_n_steps is None and not self.on_evaluate
        return bool(self.on_save)

    def __post_init__(self):
        if self.on_save is not None and not isinstance(self.on_save, bool):
            raise ConfigError("trigger.on_save", f"must be true, false or null (automatic); got {self.on_save!r}")
        n = self.every_n_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(
                "trigger.every_n_steps",
                f"must be a whole number >= 1 (leave it unset, or null, to turn this trigger off); got {n!r}",
            )
        t = self.min_interval_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ConfigError("trigger.min_interval_s", f"must be a number of seconds >= 0; got {self.min_interval_s!r}")


@dataclass
class ExportConfig:
    """What a snapshot holds and how it is laid out."""

    format: str = "hf_safetensors"
    """hf_safetensors (HF names and layout) | paddle_safetensors (Paddle names, no mapping) | callable."""
    dtype: str = "keep"
    """keep | bfloat16 | float16 | float32: dtype of the floating-point tensors in the snapshot."""
    max_shard_size: str = "5GB"
    """Largest safetensors file, e.g. '5GB', '500MB' (a bigger single tensor gets its own file)."""
    aoa: Any = "auto"
    """Name mapping: 'auto' (the model's own, else a preset), a preset name, a JSON/YAML file, or a list of statements."""
    name_template: str = "hf-step-{step:06d}"
    """Snapshot directory name inside output_dir: one {step} field as a decimal integer ({step},
    {step:d}, {step:0Nd}); distinct, parseable, safe names for every step (see plan/naming.py)."""
    copy_tokenizer: bool = True
    """Write tokenizer (and processor) files into each snapshot: export.tokenizer's, else the trainer's."""
    tokenizer: Optional[str] = None
    """A directory whose tokenizer and processor files (tokenizer.json, tokenizer_config.json, vocab and
    merges files, tokenizer.model, chat_template.jinja, preprocessor_config.json, ...) each snapshot
    gets, copied as they are: the base model's directory, for instance. Used instead of the trainer's
    tokenizer; for a trainer without one, snapshots have no tokenizer otherwise (said once at start)."""
    max_pending_bytes: str = AUTO
    """Host memory for tensors not yet on disk: auto or a size. async_write: the staging ring training copies
    into (auto: this rank's snapshot bytes, within half the node's MemAvailable / PADDLE_LOCAL_SIZE, said at
    start when that caps it; a size caps the ring). Synchronous writes, convert: the writer's budget (auto 512MB)."""
    callable: Optional[str] = None
    """For format=callable: 'package.module:function', called as fn(name, tensor, step=...)."""
    async_write: bool = False
    """Return to training once the tensors are assembled; bytes go to disk in the background."""
    timeout_s: Optional[float] = 1800.0
    """Several ranks: a rank that makes no progress for this long in one of the package's collectives
    (an export, or the decision exchange at an event) logs which rank it waits for and ends its
    process, so the launcher stops the job. null: off."""
    lora: str = "merge"
    """A LoRA model (PaddleFormers' or PaddleNLP's LoRAModel): merge (the snapshot holds W + s * A @ B,
    the model the LoRA run computes) | base (the base weights as the model holds them, no LoRA
    update: with export.peft_adapter, the base and adapter pair peft loads). Other models: ignored."""
    peft_adapter: str = "none"
    """A LoRA model: none | inside (also a Hugging Face peft adapter in <snapshot>/adapter/:
    adapter_model.safetensors and adapter_config.json, committed with the snapshot). Other models: ignored."""
    device_memory_budget: str = "64MB"
    """Parameters on an accelerator: the most device memory an export allocates at any moment, whatever
    the model's largest tensor ('0' allowed). Slices are copied to host memory in chunks (views: no
    device memory) and assembled there; a cast to export.dtype runs on the device chunk by chunk when
    a chunk fits in this budget, on the host otherwise. CPU parameters: ignored."""
    quantization: str = "none"
    """none | fp8: the snapshot's quantizable Linear weights (the architecture's declaration: attention and MLP
    projections, experts included; never embeddings, the LM head, norms, router gates, biases or vision towers)
    stored as float8_e4m3fn with a float32 ``<module>.weight_scale_inv`` per block, bit for bit transformers'
    Fp8Quantize of the weight the snapshot would hold without it (in export.dtype, widened to float32); every
    other tensor in export.dtype. Needs export.format=hf_safetensors; an architecture without a declaration is
    refused when the job starts."""
    quantization_block: Any = field(default_factory=lambda: list(DEFAULT_BLOCK))
    """export.quantization: the block [rows, columns] of one scale (default [128, 128]; a weight whose
    dimension is not a multiple of it has partial edge blocks)."""
    threads: Any = "auto"
    """Worker threads of this rank for an export's byte work (transposed copies into file order, casts,
    LoRA merges, BLAKE3), each large tensor cut into blocks of a few MB: a whole number >= 1, or auto:
    the CPUs of this rank's affinity divided among the job's ranks on the node (PADDLE_LOCAL_SIZE).
    The same threads hash and pwrite in file order; a writer's own threads only hand pieces over and fsync."""

    def __post_init__(self):
        _check_choice("export.format", self.format, EXPORT_FORMATS)
        _check_choice("export.dtype", self.dtype, _dtypes.EXPORT_DTYPES)
        _check_choice("export.lora", self.lora, LORA_MODES)
        _check_choice("export.peft_adapter", self.peft_adapter, PEFT_ADAPTER)
        if self.peft_adapter != "none" and self.format != "hf_safetensors":
            raise ConfigError("export.peft_adapter", f"a PEFT adapter holds Hugging Face names: it needs "
                                                     f"export.format=hf_safetensors, not {self.format!r}")
        self._check_quantization()
        _check_size("export.max_shard_size", self.max_shard_size)
        _check_size("export.max_pending_bytes", self.max_pending_bytes, parse=pending_budget)
        _check_size("export.device_memory_budget", self.device_memory_budget, allow_zero=True)
        n = self.threads
        if n != "auto" and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError("export.threads", f"must be a whole number >= 1 or auto (this rank's share of the "
                                                f"node's CPUs); got {n!r}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
            raise ConfigError("export.timeout_s", f"must be a number of seconds > 0 (or null: no timeout); got {t!r}")
        try:
            validate_template(self.name_template)
        except ValueError as e:
            raise ConfigError("export.name_template", str(e)) from e
        aoa = self.aoa
        if not isinstance(aoa, str) and not (
            isinstance(aoa, (list, tuple)) and all(isinstance(s, str) for s in aoa)
        ):
            raise ConfigError(
                "export.aoa",
                f"must be 'auto', a preset name, a file path, or a list of statements; got {aoa!r}",
            )
        if isinstance(aoa, str) and not aoa.strip():
            raise ConfigError("export.aoa", "is empty; use 'auto'")
        if self.tokenizer is not None:
            self._check_tokenizer()
        if self.format == "callable":
            if not self.callable or ":" not in self.callable:
                raise ConfigError(
                    "export.callable",
                    "format=callable needs export.callable='package.module:function' "
                    "(or pass fn= to FullParamExportCallback)",
                )
        elif self.callable:
            raise ConfigError("export.callable", f"is set but export.format is {self.format!r}, not 'callable'")

    def _check_quantization(self) -> None:
        _check_choice("export.quantization", self.quantization, QUANTIZATION_METHODS)
        try:
            self.quantization_block = list(check_block(self.quantization_block))
        except ValueError as e:
            raise ConfigError("export.quantization_block", str(e)) from e
        if self.quantization != "none" and self.format != "hf_safetensors":
            raise ConfigError("export.quantization", f"{self.quantization} snapshots are in the Hugging Face layout: they "
                                                     f"need export.format=hf_safetensors, not {self.format!r}")

    def _check_tokenizer(self) -> None:
        path = self.tokenizer
        if not isinstance(path, str) or not path.strip():
            raise ConfigError("export.tokenizer", f"must be a directory path (or null); got {path!r}")
        if not self.copy_tokenizer:
            raise ConfigError("export.tokenizer", "is set but export.copy_tokenizer is false: set one or the other")
        if not os.path.isdir(path):
            raise ConfigError("export.tokenizer", f"{path!r} is not a directory (give the directory that holds the "
                                                  "tokenizer files, e.g. the base model's)")
        # what it holds is checked when the export starts (models/tokenizer.py knows the file names)

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    @property
    def max_pending_auto(self) -> bool:  # the async ring is then sized by export/session/ring_size.py
        return self.max_pending_bytes == AUTO

    @property
    def max_pending(self) -> int:  # a writer's budget: the size, 512MB with auto (sizes.pending_budget)
        return pending_budget(self.max_pending_bytes)

    @property
    def device_budget(self) -> int:
        return parse_size(self.device_memory_budget, allow_zero=True)


@dataclass
class RetentionConfig:
    """Which snapshots stay. With neither keep_last nor keep_best set, all stay."""

    keep_last: int = 0
    """Keep the newest N snapshots (0: no limit by age). `latest` and `best` are never removed."""
    keep_best: int = 0
    """Keep the N best snapshots by ``metric`` (0: no limit by metric)."""
    metric: Optional[str] = None
    """The tracked evaluation metric, e.g. eval_loss; `best` points at the top snapshot."""
    mode: str = "min"
    """min | max: whether a smaller or a larger metric is better."""
    other_runs: str = "keep"
    """keep | delete: snapshots committed by another run in output_dir (an earlier job that was not
    resumed): kept, never replaced (keep), or counted by retention and replaceable (delete)."""

    def __post_init__(self):
        _check_choice("retention.other_runs", self.other_runs, ("keep", "delete"))
        for key in ("keep_last", "keep_best"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"retention.{key}", f"must be a whole number >= 0 (0 = no limit); got {v!r}")
        _check_choice("retention.mode", self.mode, ("min", "max"))
        if self.keep_best and not self.metric:
            raise ConfigError("retention.keep_best", "needs retention.metric (e.g. eval_loss) to rank snapshots by")
        if self.metric is not None and not str(self.metric).strip():
            raise ConfigError("retention.metric", "is empty; name an evaluation metric such as eval_loss")


SCHEDULES = ("routed", "seed")


@dataclass
class TopologyConfig:
    """How a multi-rank job assembles (meshes come from the job's hybrid topology)."""

    sharding_stage: Optional[int] = None
    """1/2: sharding replicas split the work; 3: sharding joins the mesh. None: from the trainer's args."""
    schedule: str = "routed"
    """``routed``: files placed where their bytes are, each missing byte sent once, point to point, to its
    writer (docs/multi-rank.md); ``seed``: the reference schedule (broadcast down columns, all-gather along
    rows: every rank of a mesh receives every slice), kept for comparison."""
    bucket_bytes: str = "2MB"
    """Per rank and collective: small slices are packed into one buffer up to this size; larger
    ones travel alone. Small buckets pipeline better (measured on CPU: 2MB 2.6x faster than
    Paddle's full_param on 1024x1024 tensors, one 128MB round 0.4x; bench/assembler.py)."""
    memory_growth_threshold: str = "1GB"
    """Most memory one collective may add on a rank (mesh size x bucket); a larger slice travels alone."""

    def __post_init__(self):
        if self.sharding_stage is not None and (isinstance(self.sharding_stage, bool) or self.sharding_stage not in (1, 2, 3)):
            raise ConfigError("topology.sharding_stage", f"must be 1, 2 or 3 (or unset); got {self.sharding_stage!r}")
        _check_choice("topology.schedule", self.schedule, SCHEDULES)
        _check_size("topology.bucket_bytes", self.bucket_bytes)
        _check_size("topology.memory_growth_threshold", self.memory_growth_threshold)

    def bucket_for(self, mesh_size: int) -> int:
        """The per-rank bucket of a mesh: the configured one, or less so a round stays under the threshold."""
        return max(1, min(parse_size(self.bucket_bytes), parse_size(self.memory_growth_threshold) // max(1, mesh_size)))


@dataclass
class CheckpointHookConfig:
    """With ``attach(trainer, ...)``: each trainer checkpoint-N/ also holds the HF snapshot of step N."""

    enabled: bool = False
    subdir: str = "hf"
    """Folder inside checkpoint-N/ that holds the snapshot."""

    def __post_init__(self):
        from ..plan.naming import _SAFE_NAME

        if not _SAFE_NAME.match(str(self.subdir)):
            raise ConfigError("checkpoint_hook.subdir", f"must be one plain directory name; got {self.subdir!r}")


# ---- the evaluation hook's scores as the tracked metric -------------------------------------------
EVALUATE_METRIC_PREFIX = "evaluate."
"""``retention.metric: evaluate.<key>`` follows the score ``<key>`` of the evaluation hook."""


@dataclass
class FullParamConfig:
    """Everything the callback needs; a recipe file is an instance of this."""

    output_dir: Optional[str] = None
    """Where snapshots go; default: <trainer output_dir>/fullparam."""
    enabled: bool = True
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    checkpoint_hook: CheckpointHookConfig = field(default_factory=CheckpointHookConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Score each committed snapshot with an evaluator in a separate process (issue 21)."""
    publish: PublishConfig = field(default_factory=PublishConfig)
    """Copy each committed snapshot to object storage, or run a command on it (issue 26)."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """Switch running serving engines to each committed snapshot (issue 39)."""
    assembler: str = "builtin"
    """builtin (this package's assembler) | paddle (Paddle's own full_param, for cross-checking)."""
    on_error: str = "warn"
    """warn: log a failed export and keep training | raise: stop training."""

    def __post_init__(self):
        _check_choice("assembler", self.assembler, ASSEMBLERS)
        _check_choice("on_error", self.on_error, ON_ERROR)
        if self.output_dir is not None and not str(self.output_dir).strip():
            raise ConfigError("output_dir", "is empty; leave it unset to use <trainer output_dir>/fullparam")
        if self.output_dir is not None:
            self.output_dir = os.path.expanduser(str(self.output_dir))  # output_dir=~/snaps on a command line
        if self.export.async_write and self.export.format == "callable":
            raise ConfigError("export.async_write", "applies to the file formats, not to export.format=callable")
        if self.export.format == "paddle_safetensors" and self.export.aoa not in ("auto",):
            raise ConfigError("export.aoa", "paddle_safetensors keeps Paddle names: leave export.aoa at 'auto'")
        self._check_evaluate()
        check_against(self, ConfigError)
        self._check_serve()

    def _check_serve(self) -> None:
        serve, timeout = self.serve, self.export.timeout_s
        if serve.enabled and self.export.format == "callable":
            raise ConfigError("serve.url", "export.format=callable writes no snapshot to serve")
        if serve.adapter:
            self._check_adapter_mode()
        bound = swap_bound_s(serve.timeout_s, serve.reload_timeout_s) + VERIFY_ALLOWANCE_S
        if serve.enabled and serve.wait and timeout is not None and bound > timeout:
            raise ConfigError("serve.wait", f"waits up to {bound:g} s for a swap (2 x (serve.reload_timeout_s + "
                                            f"serve.timeout_s) + 6 x serve.timeout_s, and {VERIFY_ALLOWANCE_S:g} s to "
                                            f"verify the snapshot), more than export.timeout_s={timeout:g}, after "
                                            "which the other ranks' watchdog stops a job that waits: raise "
                                            "export.timeout_s or lower serve.reload_timeout_s")

    def _check_adapter_mode(self) -> None:
        """``serve.adapter``: engines load each snapshot's PEFT adapter, which this mode makes the export write."""
        serve = self.serve
        if not serve.enabled:
            raise ConfigError("serve.adapter", "is true, but serve.url names no engine")
        if self.export.format != "hf_safetensors":
            raise ConfigError("serve.adapter", f"loads each snapshot's PEFT adapter, which holds Hugging Face names: "
                                               f"it needs export.format=hf_safetensors, not {self.export.format!r}")
        if snapshot_step_pattern(self.export.name_template).fullmatch(serve.adapter_name):
            raise ConfigError("serve.adapter_name", f"{serve.adapter_name!r} reads as a snapshot's name "
                                                    f"(export.name_template={self.export.name_template!r}), which "
                                                    "serve.keep_adapters loads adapters under: choose another name")
        self.export.peft_adapter = "inside"  # the adapter each snapshot's engines load

    def _check_evaluate(self) -> None:
        problem = lm_eval_against(self.evaluate, self.serve)
        if problem:
            raise ConfigError(*problem)
        metric = self.retention.metric
        if metric and str(metric).startswith(EVALUATE_METRIC_PREFIX) and not self.evaluate.enabled:
            raise ConfigError("retention.metric", f"{metric!r} follows a score of the evaluation hook, but neither "
                                                  "evaluate.command, evaluate.callable nor evaluate.lm_eval.tasks is set")
        if self.evaluate.enabled and self.export.format == "callable":
            raise ConfigError("evaluate.command" if self.evaluate.command else "evaluate.callable" if self.evaluate.callable
                              else "evaluate.lm_eval.tasks",
                              "export.format=callable writes no snapshot to evaluate")
