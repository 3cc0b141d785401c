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
import os
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional

from ..config.recipes import coerce_config
from ..config.schema import FullParamConfig
from ..export.runner import ExportError, ExportSession, SnapshotInfo
from .model_info import build_model_source
from .topology import build_context

logger = logging.getLogger("paddle_fullparam_callbacks")


class FullParamExportCallback:
    """Export full-parameter snapshots at save / eval / every-N-steps / train-end boundaries.

    Args:
        config: a :class:`FullParamConfig`, a recipe name or path, a dict of recipe keys, or None.
        overrides: ``key=value`` recipe overrides applied on top of ``config``.
        output_dir: shortcut for the ``output_dir`` key.
        fn: the function for ``export.format=callable``: ``fn(name, tensor, step=...)``.
    """

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
        self.events: List[str] = []  # the export decisions taken: "reason@step"
        self._last_step: Optional[int] = None
        self._last_metrics: dict = {}
        self._source = None
        self._rank, self._world_size = 0, 1

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

    def _setup(self, args, model, tokenizer) -> None:
        """Validate everything (output dir, mapping, plan) and create the groups, before the first step.

        Collective: every rank of the job calls it, at on_train_begin.
        """
        if self.session is not None:
            return
        ctx = build_context(args, self.config.topology.sharding_stage)
        self._rank, self._world_size = ctx.rank, ctx.world_size
        session = ExportSession(self.config, self._output_dir(args), fn=self.fn, ctx=ctx)
        session.start()
        self._source = build_model_source(model, self.config, tokenizer)
        session.prepare(self._source)
        self.session = session

    # ---- events ----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, tokenizer=None, **kwargs):
        if self.config.enabled and model is not None:
            self._setup(args, model, tokenizer if tokenizer is not None else kwargs.get("processing_class"))

    def on_step_end(self, args, state, control, **kwargs):
        n = self.config.trigger.every_n_steps
        if n and state.global_step > 0 and state.global_step % n == 0:
            self._export(args, state, kwargs, "every_n_steps")

    def on_save(self, args, state, control, **kwargs):
        if self.config.trigger.on_save:
            self._export(args, state, kwargs, "save")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics:
            self._last_metrics = dict(metrics)
        if self.config.trigger.on_evaluate:
            self._export(args, state, kwargs, "evaluate")

    def on_train_end(self, args, state, control, **kwargs):
        if self.config.trigger.on_train_end:
            self._export(args, state, kwargs, "train_end")

    # ---- the export ------------------------------------------------------------------------
    def _export(self, args, state, kwargs, reason: str) -> Optional[SnapshotInfo]:
        if not self.config.enabled:
            return None
        step = int(state.global_step)
        if step == self._last_step:
            return None  # two triggers on one step make one snapshot
        model = kwargs.get("model")
        if self.session is None:
            if model is None:
                return None
            self._setup(args, model, kwargs.get("tokenizer") or kwargs.get("processing_class"))
        self._last_step = step
        self.events.append(f"{reason}@{step}")
        tokenizer = kwargs.get("tokenizer") or kwargs.get("processing_class")
        if tokenizer is not None:
            self._source.tokenizer = tokenizer
        try:
            info = self.session.export(self._source, step, metrics=self._last_metrics, reason=reason)
        except ExportError as e:
            self.errors.append(str(e))
            if self.config.on_error == "raise":
                raise
            logger.warning("full-parameter export failed, training continues (on_error=warn): %s", e)
            return None
        self.snapshots.append(info)
        return info
