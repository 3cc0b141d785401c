"""The sections of the consumers of committed snapshots: ``evaluate`` (issue 21), ``publish`` (issue 26) and
``serve`` (issue 39), each validated on construction; ``schema.FullParamConfig`` composes them and checks
them against the rest of the recipe."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from .errors import ConfigError, check_number as _check_number
from .evaluating import command_problem, lm_eval_problem
from .publishing import check_publish
from .serving import check_serve


@dataclass
class LmEvalConfig:
    """The bundled lm-evaluation-harness evaluator (issue 41): the harness's Python API on each snapshot, offline."""

    tasks: List[str] = field(default_factory=list)
    """The tasks (or groups, or tags) to run, e.g. [pfc_choice, pfc_generate]; empty: this evaluator is off. Their
    metrics are the scores evaluate.lm_eval.<task>.<metric> (the filter kept where a task has several:
    evaluate.lm_eval.gsm8k.exact_match,strict-match)."""
    include_path: Optional[str] = None
    """The folder of task files (YAML, and their local data: data_files named relatively are read from this folder);
    null: the bundled pair pfc_choice (multiple_choice) and pfc_generate (generate_until)."""
    builtin_tasks: bool = False
    """Also index the harness's own ~14,000 task files (about 20 s per evaluation); their data must be in the
    datasets cache, since the evaluator runs offline."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per prompt; null: each task's own."""
    limit: Optional[float] = None
    """Documents per task: a count (>= 1) or a fraction (< 1); null: all."""
    batch_size: int = 1
    """Requests per forward pass (hf) or per HTTP request (engine)."""
    backend: str = "hf"
    """hf: transformers on the snapshot's files, float32 on the CPU | engine: the serving engine that serves the
    snapshot (serve.url), with token-id requests; a score counts only if the engine served that very snapshot from
    the first request to the last."""
    engine_url: Optional[str] = None
    """backend=engine: which of serve.url to score on; null: the first."""
    engine_wait_s: float = 300.0
    """backend=engine: how long an evaluation waits for the engine to serve its snapshot (serving runs beside it)
    before it gives up and records the result as discarded."""
    engine_hold: bool = True
    """backend=engine: the engine stays on a snapshot until its evaluation is over (the next swap waits; when it
    goes, the newest snapshot waiting is served and the others are recorded as skipped), so every snapshot the
    engine serves is scored; false: swaps never wait for evaluations (an evaluation whose snapshot was replaced
    meanwhile is discarded). Training never waits for it."""
    log_samples: bool = False
    """Keep every request and answer (lm-eval's samples) in the raw results file beside the record."""

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def __post_init__(self):
        problem = lm_eval_problem(self)
        if problem:
            raise ConfigError(*problem)


@dataclass
class EvaluateConfig:
    """Score committed snapshots with an evaluator in a separate process while training goes on."""

    command: Optional[str] = None
    """A command line run once per evaluated snapshot, split like a shell would (no shell features:
    pipes and redirections need an explicit `sh -c '...'`), with {snapshot} (its absolute path), {step},
    {output} (a file for its JSON result) and {python} (evaluate.python) filled in. Its result: a JSON
    object written to {output}, or else its last line on stdout."""
    callable: Optional[str] = None
    """'package.module:function' instead of a command, run in a separate process of evaluate.python as
    fn(snapshot=..., step=..., output=...); it returns the result (a dict) or writes it to output."""
    python: Optional[str] = None
    """The interpreter of {python} and of evaluate.callable (the evaluator may need another environment
    than training): a path, a command on PATH, or $NAME, an environment variable holding one (read when
    the job starts). null: this job's own interpreter."""
    every: int = 1
    """Evaluate every k-th committed snapshot of the job (1: each one); 0: none by count (evaluate.last)."""
    last: bool = True
    """Also evaluate the last snapshot committed by the training, whatever evaluate.every says."""
    max_concurrent: int = 1
    """Evaluations running at once; the others wait in line (their snapshots are kept meanwhile)."""
    timeout_s: float = 3600.0
    """An evaluation running longer is stopped (its process group: SIGTERM, then SIGKILL) and recorded as timed out."""
    wait_at_end_s: float = 600.0
    """At the end of training, wait this long for evaluations still running or waiting; the rest is
    stopped and recorded as unfinished (`paddle-fullparam evaluate` runs them later)."""
    nice: int = 10
    """CPU priority of the evaluator (os.nice increment, 0-19): it yields the CPU to training."""
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """The bundled lm-evaluation-harness evaluator instead of a command: evaluate.lm_eval.tasks names the tasks."""

    @property
    def enabled(self) -> bool:
        return bool(self.command or self.callable or self.lm_eval.enabled)

    def __post_init__(self):
        if self.command is not None and self.callable is not None:
            raise ConfigError("evaluate.callable", "is set together with evaluate.command: give one of them")
        if self.command is not None:
            problem = command_problem(self.command)
            if problem:
                raise ConfigError("evaluate.command", problem)
        if self.callable is not None:
            module, _, fn = str(self.callable).partition(":")
            if not module.strip() or not fn.strip():
                raise ConfigError("evaluate.callable", f"must be 'package.module:function'; got {self.callable!r}")
        py = self.python
        if py is not None:
            if not isinstance(py, str) or not py.strip():
                raise ConfigError("evaluate.python", f"must be an interpreter path, a command or $NAME (or null); got {py!r}")
            if py.startswith("$") and not py[1:].replace("_", "a").isalnum():
                raise ConfigError("evaluate.python", f"{py!r}: $NAME must name an environment variable (letters, digits, _)")
        _check_number("evaluate.every", self.every, 0, integer=True)
        _check_number("evaluate.max_concurrent", self.max_concurrent, 1, integer=True)
        _check_number("evaluate.timeout_s", self.timeout_s, 0, strict=True)
        _check_number("evaluate.wait_at_end_s", self.wait_at_end_s, 0)
        _check_number("evaluate.nice", self.nice, 0, integer=True, high=19)
        if self.enabled and not self.every and not self.last:
            raise ConfigError("evaluate.every", "is 0 and evaluate.last is false: no snapshot would be evaluated; "
                                                "set evaluate.every=1 (each snapshot) or evaluate.last=true")

@dataclass
class PublishConfig:
    """Copy each committed snapshot to object storage (url), or run a command on it, in a separate process."""

    url: Optional[str] = None
    """s3://bucket/prefix (snapshots at <prefix>/<name>/); credentials from the AWS chain, as boto3 reads it."""
    command: Optional[str] = None
    """Instead of url: a command per snapshot, with {snapshot}, {name}, {step}, {output}, {python} filled in."""
    endpoint_url: Optional[str] = None
    """http(s)://host[:port] of an S3-compatible store (MinIO, Ceph RGW, BOS, OSS); null: the AWS chain's."""
    region: Optional[str] = None
    """The store's region; null: the AWS chain's (AWS_REGION, ~/.aws/config)."""
    part_size: str = "64MB"
    """Multipart part size, 5MiB to 5GiB (raised for a file that would need over 10,000 parts); smaller files: one PUT."""
    concurrency: int = 4
    """Parts uploaded at once; lowered so that (concurrency + 1) parts fit in max_memory."""
    max_memory: str = "512MB"
    """Host memory for parts read and in flight (at least two parts)."""
    retries: int = 5
    """Retries of a request the store throttled (SlowDown, 503) or failed (5xx, dropped connection)."""
    retry_backoff_s: float = 0.5
    """The first retry's wait, doubled at each next one (at most 30 s), with jitter."""
    check_etag: bool = True
    """Compare the store's ETags with the local MD5s after upload (false where ETags are no MD5: SSE-KMS)."""
    require_conditional_writes: bool = True
    """The start proves the store honours If-None-Match and If-Match; false: such a store is used with a warning."""
    keep_last: int = 0
    """Remote retention: this run's newest N published snapshots stay (0: all). Remote latest and best stay."""
    keep_best: int = 0
    """Remote retention: the N best by retention.metric stay (0: no limit by metric)."""
    timeout_s: float = 21600.0
    """One snapshot's publication running longer is stopped and recorded as failed."""
    wait_at_end_s: float = 600.0
    """At the end of training, wait this long for publications; the rest is recorded as unfinished."""
    nice: int = 10
    """CPU priority of the publishing process (os.nice increment, 0-19)."""

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.command)

    def __post_init__(self):
        check_publish(self, ConfigError)


@dataclass
class ServeConfig:
    """Switch running serving engines to each committed snapshot, with no restart (issue 39)."""

    url: Any = None
    """The base URL of a serving engine (http://host:8000), or a list of them: every replica. Each engine is
    switched to every committed snapshot in place (pause, reload from disk, name, resume), requests kept."""
    engine: str = "vllm"
    """The engines' protocol: vllm (its dev-mode endpoints: start it with VLLM_SERVER_DEV_MODE=1)."""
    path_template: str = "{snapshot}"
    """The snapshot's path as the engines see it: {snapshot} (its absolute path here), {name}, {step}; e.g.
    /models/{name} for engines on another node or in a container that mounts output_dir at /models."""
    wait: bool = False
    """true: an export returns only once every engine serves its snapshot (or failed to); false: training
    never waits for the engines."""
    api_key_env: Optional[str] = None
    """The environment variable that holds the engines' API key (vLLM's --api-key), sent as a bearer token;
    the key itself never goes in a recipe."""
    timeout_s: float = 30.0
    """Each call to an engine but the reload (pause, naming the weights, resume, the start's checks)."""
    reload_timeout_s: float = 600.0
    """An engine's reload of a snapshot's weights."""
    check_model: bool = True
    """At start, refuse a job whose snapshots do not fit the model an engine serves (architecture, tensor
    names and shapes), read from the engine's model directory where it can be read here."""
    wait_at_end_s: float = 600.0
    """At the end of training, wait this long for the last snapshot to be served."""
    adapter: bool = False
    """A LoRA run: load each snapshot's PEFT adapter into the engines (vLLM's /v1/load_lora_adapter, in
    milliseconds) instead of reloading its weights; the engines keep their base weights and are never paused.
    Turns on export.peft_adapter. Checked at start: a LoRA run, engines with LoRA and runtime loading on, the
    run's base on the engines, an adapter they accept."""
    adapter_name: str = "latest"
    """serve.adapter: the stable name clients request (their ``model``), loaded in place with each snapshot's
    adapter."""
    keep_adapters: int = 0
    """serve.adapter: also load each snapshot's adapter under the snapshot's own name (hf-step-000008) and keep
    the last N of them (older ones unloaded), for A/B between steps; 0: only serve.adapter_name."""
    base_tolerance: float = 0.05
    """serve.adapter: at start, the largest mean |difference| (nats) between an engine's prompt log-probabilities
    on its base model and the run's own forward of its base (LoRA off) before the engine's base counts as another
    model. float32 on both sides agrees to 1e-6; another model differs by tenths to nats."""

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    @property
    def urls(self) -> list:
        return list(self.url or [])

    def __post_init__(self):
        check_serve(self, ConfigError)
