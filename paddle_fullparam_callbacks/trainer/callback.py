"""``FullParamExportCallback``: full-parameter HF snapshots from inside a Trainer.

Works unchanged with the PaddleFormers and the PaddleNLP Trainer: both call
``callback.on_<event>(args, state, control, model=..., tokenizer=..., ...)``; this class does not
subclass either framework's ``TrainerCallback`` (so importing it needs neither), and answers
every event it does not use with a no-op.

One line::

    trainer.add_callback(FullParamExportCallback(output_dir="snapshots", overrides=["trigger.every_n_steps=100"]))

or from a recipe::

    FullParamExportCallback.from_recipe("hf_every_n_steps", overrides=["retention.keep_last=3"])
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from ..config.recipes import coerce_config
from ..config.schema import EVALUATE_METRIC_PREFIX, FullParamConfig
from ..export.session.session import ExportSession
from ..export.source import ExportError, SnapshotInfo
from ..models import processor as processors
from ..models.model_info import build_model_source, unwrap_model
from ..plan.decisions import Decision, decide
from .evaluation import TrainerEvaluations
from .publishing import TrainerPublishing
from .serving import TrainerServing, adapter_source, engine_holds
from .paths import check_trainer_paths
from .topology import build_context, expert_axes_of

logger = logging.getLogger("paddle_fullparam_callbacks")


class FullParamExportCallback:
    """Export full-parameter snapshots at save / eval / every-N-steps / train-end boundaries.

    Args:
        config: a :class:`FullParamConfig`, a recipe name or path, a dict of recipe keys, or None.
        overrides: ``key=value`` recipe overrides applied on top of ``config``.
        output_dir: shortcut for the ``output_dir`` key.
        fn: the function for ``export.format=callable``: ``fn(name, tensor, step=...)``.
    """

    processing_class = None  # the trainer's processor, which PaddleFormers does not hand callbacks (attach() sets it)

    def __init__(
        self,
        config: "FullParamConfig | str | dict | None" = None,
        *,
        overrides: Iterable[str] = (),
        output_dir: Optional[str] = None,
        fn: Optional[Callable] = None,
    ):
        overrides = list(overrides)
        if output_dir is not None:
            overrides.append(f"output_dir={output_dir}")
        self.config: FullParamConfig = coerce_config(config, overrides)
        self.fn = fn
        self.session: Optional[ExportSession] = None
        self.snapshots: List[SnapshotInfo] = []
        self.errors: List[str] = []
        self.events: List[str] = []  # the exports made: "reason@step"
        self.decisions: List[str] = []  # every decision, exports and skips: "reason@step"
        self.trainer = None  # set by attach(): stall seconds then go through trainer.log
        self._hooked = False
        self._last_time: Optional[float] = None
        self._last_step: Optional[int] = None
        self._source = None
        holds = engine_holds(self.config)  # evaluate.lm_eval.engine_hold: evaluations that hold the engine's swaps
        self.evaluation = TrainerEvaluations(self.config, holds)  # the evaluation hook's results: .results
        self.publishing = TrainerPublishing(self.config)  # the publisher's results: .results
        self.serving = TrainerServing(self.config, holds)  # the engines' swaps: .results
        self._consumers = (self.evaluation, self.publishing, self.serving)  # in the order they hang on commits

    @classmethod
    def from_recipe(cls, recipe, overrides: Iterable[str] = (), **kwargs) -> "FullParamExportCallback":
        return cls(recipe, overrides=overrides, **kwargs)

    def __getattr__(self, name: str):
        # every trainer event we do not use (on_log, on_step_begin, on_optimizer_end, ...)
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    # ---- setup -----------------------------------------------------------------------------
    def _output_dir(self, args) -> Path:
        if self.config.output_dir:
            return Path(self.config.output_dir)
        base = getattr(args, "output_dir", None) or "."
        return Path(base) / "fullparam"

    def _setup(self, args, state, model, tokenizer) -> None:
        """Validate everything (output dir, mapping, plan) and create the groups, before the first step.

        Collective: every rank of the job calls it, at on_train_begin. A trainer that starts at a
        step > 0 resumed from a checkpoint: the job continues the run of the snapshots there.
        """
        if self.session is not None and self.session.is_open:
            return
        check_trainer_paths(self.config, self._output_dir(args), getattr(args, "output_dir", None))
        ctx = build_context(args, self.config.topology.sharding_stage, expert_axes_of(unwrap_model(model)))
        exp = self.config.export
        warn = ctx.is_coordinator and exp.copy_tokenizer and exp.format == "hf_safetensors"
        tokenizer = processors.with_processor(tokenizer, self.processing_class)
        if warn and tokenizer is not None and not exp.tokenizer and processors.missing_processor(unwrap_model(model), tokenizer):
            logger.warning("%s", processors.NO_PROCESSOR)
        self.evaluation.check(ctx)  # evaluate.python, before anything is made on disk
        self.publishing.check(ctx)  # the store proven usable (publish.url), before anything is made on disk
        session = ExportSession(self.config, self._output_dir(args), fn=self.fn, ctx=ctx)
        # the checkpoint hook commits into <trainer output_dir>/checkpoint-N/: every rank must see it too
        trainer_dir = getattr(args, "output_dir", None)
        shared = [("checkpoint_hook.enabled", Path(trainer_dir))] if self.config.checkpoint_hook.enabled and trainer_dir else []
        session.start(resume=bool(getattr(state, "global_step", 0)), shared=shared)
        try:
            self._source = adapter_source(lambda: build_model_source(model, self.config, tokenizer,
                                                                     warn_no_tokenizer=warn), self.config)
            # the async staging ring waits for the first step's end (on_step_end): sized from the memory the
            # training leaves once its optimizer has created its states (ring_size.py)
            prepared = session.prepare(self._source, ring=False)
            # every engine proven, against the plan's tensors (a LoRA run served as adapters: against its adapter)
            self.serving.check(ctx, self._source, prepared, model=model, session=session)
        except BaseException:  # refused at start: the directory is released (and removed, if it made it)
            session.close()
            raise
        self.session = session
        self.evaluation.start(session, trainer_dir)
        self.publishing.start(session)
        self.serving.start(session)

    # ---- events ----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, tokenizer=None, **kwargs):
        if self.config.enabled and model is not None:
            self._setup(args, state, model, tokenizer if tokenizer is not None else kwargs.get("processing_class"))

    def _drain(self, state) -> None:
        """Finished evaluations, publications and swaps (the coordinator's; no collective)."""
        for consumer in self._consumers:
            consumer.drain(self.session, state, self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        self._drain(state)
        if self.session is not None and self.session.is_open:
            self.session.stage_ring()  # the first step's end: the async ring, once (no collective)
        n = self.config.trigger.every_n_steps
        if n and state.global_step > 0 and state.global_step % n == 0:
            self._event(args, state, kwargs, "every_n_steps")

    def on_save(self, args, state, control, **kwargs):
        # with the checkpoint hook, the save-time snapshot goes into checkpoint-N/ instead
        if self.config.trigger.exports_on_save and not self._hooked:
            self._event(args, state, kwargs, "save")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = dict(metrics or {})
        self._drain(state)
        if self.config.trigger.on_evaluate or self._trainer_metric:
            self._event(args, state, kwargs, "evaluate", metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.config.trigger.on_train_end:
            self._event(args, state, kwargs, "train_end")
        self._finish_pending(state)
        for consumer in self._consumers:  # each waits up to its wait_at_end_s; the rest is recorded
            consumer.finish(self.session, state, self.trainer)
        if self.session is not None:
            # the output directory is this training's while it runs; a later train() (a resume in
            # the same process) sets up again
            self.session.close()

    def export_into_checkpoint(self, args, state, model, tokenizer=None) -> Optional[SnapshotInfo]:
        """The checkpoint hook: the snapshot of this step goes into ``<output_dir>/checkpoint-N/<subdir>``,
        committed atomically like any snapshot, so the trainer's rotation removes both together."""
        if not self.config.enabled:
            return None
        if self.session is None or not self.session.is_open:
            self._setup(args, state, model, tokenizer)
        step = int(state.global_step)
        ckpt = Path(args.output_dir) / f"checkpoint-{step}"
        self._finish_pending(state)
        self.events.append(f"checkpoint@{step}")
        info = self._run(lambda: self.session.export(self._source, step, reason="checkpoint", into=ckpt,
                                                     name=self.config.checkpoint_hook.subdir), state)
        self._wait_served(info, state, f"{ckpt.name}/{self.config.checkpoint_hook.subdir}")
        return info

    # ---- decisions -------------------------------------------------------------------------
    @property
    def _trainer_metric(self) -> Optional[str]:
        """retention.metric when it is one of the trainer's evaluation metrics (not evaluate.<score>)."""
        metric = self.config.retention.metric
        return None if not metric or metric.startswith(EVALUATE_METRIC_PREFIX) else metric

    def _decide(self, reason: str, step: int, metrics: Optional[dict]) -> Decision:
        """Taken on the coordinator and shared: every rank acts on the same decision and metric."""
        ctx = self.session.ctx
        proposal = None
        if ctx.is_coordinator:
            try:
                d = decide(reason, step, time.time(), self._last_step, self._last_time,
                           self.config.trigger.min_interval_s,
                           self._trainer_metric if reason == "evaluate" else None, metrics)
                if reason == "evaluate" and not self.config.trigger.on_evaluate:
                    d = Decision(False, "track: metric only", step, d.metric)
                proposal = (d.export, d.reason, d.metric, None)
            except (KeyError, ValueError) as e:
                proposal = (False, "error", None, str(e.args[0]) if e.args else str(e))
        if ctx.watchdog is not None:
            ctx.watchdog.step = step
        export, why, metric, err = ctx.all_gather_object(proposal, what="decision")[ctx.coordinator]
        if err:
            raise ValueError(err)
        return Decision(export, why, step, metric)

    def _event(self, args, state, kwargs, reason: str, metrics: Optional[dict] = None) -> Optional[SnapshotInfo]:
        if not self.config.enabled:
            return None
        if self.session is None or not self.session.is_open:
            model = kwargs.get("model")
            if model is None:
                return None
            self._setup(args, state, model, kwargs.get("tokenizer") or kwargs.get("processing_class"))
        step = int(state.global_step)
        d = self._decide(reason, step, metrics)
        self.decisions.append(f"{d.reason}@{step}")
        if reason == "evaluate" and d.metric is not None and not d.export and step == self._last_step:
            # the step was exported by an earlier trigger (e.g. every_n_steps before the evaluation):
            # its snapshot gets the metric, so best-by-metric sees it
            self._finish_pending(state)
            self.session.annotate(step, {self.config.retention.metric: d.metric, **(metrics or {})})
        if not d.export:
            return None
        self._finish_pending(state)
        self._last_step, self._last_time = step, time.time()
        self.events.append(f"{reason}@{step}")
        tokenizer = kwargs.get("tokenizer") or kwargs.get("processing_class")
        if tokenizer is not None and not self.config.export.tokenizer:  # export.tokenizer's files win
            self._source.tokenizer = processors.with_processor(tokenizer, self.processing_class)
        info = self._run(lambda: self.session.export(self._source, step, metrics=metrics if reason == "evaluate" else None,
                                                     reason=reason), state)
        self._wait_served(info, state, info.name if info is not None else None)
        return info

    def _wait_served(self, info: Optional[SnapshotInfo], state, name: Optional[str]) -> None:
        """``serve.wait``: the export returns once every engine serves it (a background export commits first)."""
        if not (self.config.serve.enabled and self.config.serve.wait) or info is None:
            return
        if info.pending:
            self._finish_pending(state)
        self.serving.wait(self.session.ctx, name)

    def _run(self, export_fn, state) -> Optional[SnapshotInfo]:
        try:
            info = export_fn()
        except ExportError as e:
            self._report(e)
            return None
        self._record(info, state)
        return info

    def _finish_pending(self, state) -> None:
        """Wait for a background export to commit (collective); its errors are reported here."""
        if self.session is None or not self.session.has_pending:
            return
        try:
            info = self.session.wait_pending()
        except ExportError as e:
            self._report(e)
            return
        if info is not None:
            self.snapshots = [info if (s.pending and s.name == info.name) else s for s in self.snapshots]

    def _report(self, e: Exception) -> None:
        self.errors.append(str(e))
        if self.config.on_error == "raise":
            raise e
        logger.warning("full-parameter export failed, training continues (on_error=warn): %s", e)

    def _record(self, info: SnapshotInfo, state) -> None:
        self.snapshots.append(info)
        entry = {"fullparam/stall_s": round(info.stall_s, 4), "fullparam/snapshot": info.name, "step": info.step}
        if self.trainer is not None and hasattr(self.trainer, "log"):
            # on every rank, as the trainer itself logs (its loggers write on rank 0 only)
            self.trainer.log({"fullparam/stall_s": round(info.stall_s, 4)})
        elif state is not None and hasattr(state, "log_history"):
            state.log_history.append(entry)
