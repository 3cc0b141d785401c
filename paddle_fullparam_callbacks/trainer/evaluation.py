"""The callback's side of the evaluation hook (``consumers/evaluate/``): set up, drained, finished.

Only the coordinator evaluates (the hook hangs on its Committer, which commits every snapshot);
the other ranks take part in one exchange at start, so that a wrong ``evaluate.python`` stops
every rank alike before training. Finished evaluations are collected on the training thread at
the next trainer event: their scores go through ``trainer.log`` as ``fullparam/eval/<key>`` (or
into ``state.log_history`` without ``attach``), a failure is logged once, and ``best`` and
retention are refreshed (coordinator file operations, as after a commit: no collective, so the
ranks cannot diverge).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

from ..config.schema import ConfigError, FullParamConfig
from ..export.commit.retention import list_snapshots
from ..consumers.evaluate import Evaluation, EvaluationHook, check_lm_eval, recover, resolve_python
from .consumers import TrainerConsumer, log_row, snapshot_label

logger = logging.getLogger("paddle_fullparam_callbacks")
PREFIX = "fullparam/eval/"


class TrainerEvaluations(TrainerConsumer):
    """What the callback keeps of the evaluation hook: the hook (coordinator) and every result."""

    KEY, JOBS = "evaluate", "evaluation(s)"

    def __init__(self, config: FullParamConfig, holds=None):
        super().__init__(config)
        self.holds = holds  # evaluate.lm_eval.engine_hold (trainer/serving.engine_holds)
        self.hook: Optional[EvaluationHook] = None
        self.python: Optional[List[str]] = None

    def check(self, ctx) -> None:
        """Every rank, before the session starts: the coordinator finds ``evaluate.python`` (and proves
        ``evaluate.lm_eval`` there: the harness, the tasks, their data files); one exchange shares a failure,
        so that every rank raises the same ConfigError."""
        if not self.enabled:
            return
        failure = None
        if ctx.is_coordinator:
            try:
                self.python = resolve_python(self.config.evaluate)
                if self.config.evaluate.lm_eval.enabled:  # the harness, the tasks and their data, in that environment
                    check_lm_eval(self.config.evaluate.lm_eval, self.python)
            except ConfigError as e:
                failure = (e.key, str(e)[len(e.key) + 2:])
        failure = ctx.all_gather_object(failure, what="evaluate.python")[ctx.coordinator]
        if failure:
            raise ConfigError(*failure)

    def start(self, session, trainer_dir: Optional[str]) -> None:
        """Coordinator: the hook on the session's commits, and what earlier jobs' evaluations left settled."""
        if not self.enabled or not session.ctx.is_coordinator or self.python is None:
            return
        hook = EvaluationHook(self.config.evaluate, self.python, run_id=session.run_id,
                              api_key_env=self.config.serve.api_key_env, holds=self.holds, serve=self.config.serve)

        def evaluation(job) -> None:
            path = Path(job.out_dir) / job.name
            hook.committed(snapshot_label(job), path, job.step, in_output_dir=job.pointers)

        self.connect(session.committer, evaluation, hook.busy)
        settled, alive = recover(self._snapshots(session, trainer_dir), hook)
        for ev in settled:
            logger.info("evaluation of %s, left by an earlier job, recorded at this start: %s", ev.name, describe(ev))
        self.results.extend(settled)
        if alive:
            logger.info("evaluations an earlier job left running are watched and recorded when they end: %s",
                        ", ".join(ev.name for ev in alive))
        self.hook = hook

    def _snapshots(self, session, trainer_dir: Optional[str]):
        out = [(e.name, e.step, e.path, True) for e in list_snapshots(session.output_dir, session.pattern)]
        hook = self.config.checkpoint_hook
        if hook.enabled and trainer_dir and Path(trainer_dir).is_dir():
            for ckpt in sorted(Path(trainer_dir).glob("checkpoint-*")):
                snap = ckpt / hook.subdir
                step = ckpt.name.rpartition("-")[2]
                if snap.is_dir() and step.isdigit():
                    out.append((f"{ckpt.name}/{hook.subdir}", int(step), snap, False))
        return out

    def drain(self, session, state, trainer=None) -> List[Evaluation]:
        """The training thread, at an event: log what finished and refresh ``best`` and retention."""
        if self.hook is None:
            return []
        done = self.hook.drain()
        for ev in done:
            self.results.append(ev)
            self._log(ev, state, trainer)
        self._after_drain(session, done, any(ev.in_output_dir for ev in done))
        return done

    def _log(self, ev: Evaluation, state, trainer) -> None:
        if ev.status == "ok":
            logger.info("evaluation of %s (step %d): %s", ev.name, ev.step, describe(ev))
            entry = {PREFIX + k: v for k, v in ev.scores.items()}
        else:  # logged once, here; the record keeps the details
            logger.warning("evaluation of %s (step %d) %s: %s (log: %s); training continues, the snapshot stays",
                           ev.name, ev.step, ev.status, (ev.record or {}).get("error"), ev.path / "fullparam_eval.log")
            entry = {PREFIX + ("discarded" if ev.status == "discarded" else "failed"): 1.0}
        entry[PREFIX + "snapshot_step"] = float(ev.step)
        log_row(entry, state, trainer)

    def _before_close(self, session, state, trainer) -> None:
        self.hook.training_ended()  # evaluate.last: the last snapshot too


def describe(ev: Evaluation) -> str:
    record = ev.record or {}
    if ev.status == "ok":
        scores = ", ".join(f"{k}={v:.6g}" for k, v in list(ev.scores.items())[:8]) or "no numeric score"
        return f"ok, {scores} ({record.get('seconds', 0):.1f} s)"
    return f"{ev.status}: {record.get('error')}"
