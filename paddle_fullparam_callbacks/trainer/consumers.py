"""The callback's side of a consumer of committed snapshots (``consumers/``: evaluation, publication,
serving), one piece for all three: the hook hangs on the coordinator's Committer (:meth:`TrainerConsumer.connect`,
beside the others), finished jobs are drained on the training thread at the next trainer event and go to the
trainer's log (:func:`log_row`), and the end of training waits up to the section's ``wait_at_end_s``
(:meth:`TrainerConsumer.finish`). Each consumer says what is its own: its check at start, its hook, how a
finished job is logged.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable, List

from ..config.schema import FullParamConfig

logger = logging.getLogger("paddle_fullparam_callbacks")


def log_row(row: dict, state, trainer) -> None:
    """A row of numbers into the trainer's log (``trainer.log`` with ``attach``), else ``state.log_history``."""
    if trainer is not None and hasattr(trainer, "log"):
        trainer.log(dict(row))
    elif state is not None and hasattr(state, "log_history"):
        state.log_history.append({**row, "step": getattr(state, "global_step", None)})


def snapshot_label(job) -> str:
    """A committed snapshot's name for its consumers: ``hf-step-000010``, or ``checkpoint-10/hf`` for the
    checkpoint hook's (committed inside a trainer checkpoint)."""
    return job.name if job.pointers else f"{Path(job.out_dir).name}/{job.name}"


class TrainerConsumer:
    """What the callback keeps of one consumer: its hook (the coordinator's) and every finished job."""

    KEY = ""  # the recipe section: evaluate | publish | serve
    JOBS = ""  # what a job is called in the log: evaluation(s), publication(s), swap(s)

    def __init__(self, config: FullParamConfig):
        self.config = config
        self.hook = None
        self.results: List = []  # every job finished while this job ran (or settled at its start)
        self.waited_s = 0.0  # how long the end of training waited for the jobs

    @property
    def section(self):
        return getattr(self.config, self.KEY)

    @property
    def enabled(self) -> bool:
        return self.section.enabled

    @staticmethod
    def connect(committer, committed: Callable, busy: Callable[[], Iterable[str]]) -> None:
        """Tell this consumer of each commit (after the consumers connected before it) and keep its busy
        snapshots; one consumer's trouble is never another's, nor the commit's."""
        before_commit, before_busy = committer.on_commit, committer.busy

        def on_commit(job) -> None:
            if before_commit is not None:
                before_commit(job)
            try:
                committed(job)
            except Exception as e:  # the snapshot is committed: a job that cannot be queued is no failure of it
                logger.warning("snapshot %s is committed, but %s could not take it: %s", job.name,
                               getattr(committed, "__qualname__", "a consumer"), e)

        committer.on_commit = on_commit
        committer.busy = lambda: set(before_busy()) | set(busy())

    def drain(self, session, state, trainer=None) -> list:
        """The training thread, at an event: what finished since the last drain, logged."""
        raise NotImplementedError

    def _before_close(self, session, state, trainer) -> None:
        """The end of training, before waiting (e.g. the last snapshot queued, ``best`` followed)."""

    def finish(self, session, state, trainer=None) -> None:
        """The end of training: wait up to ``<section>.wait_at_end_s`` for the jobs in line or running; the
        hook records the rest; everything finished is drained and logged."""
        if self.hook is None:
            return
        self._before_close(session, state, trainer)
        wait = self.section.wait_at_end_s
        waiting = self.hook.pending()
        if waiting:
            logger.info("waiting up to %.0f s (%s.wait_at_end_s) for %d %s", wait, self.KEY, waiting, self.JOBS)
        t0 = time.perf_counter()
        self.hook.close(wait)
        self.waited_s = time.perf_counter() - t0 if waiting else 0.0
        self.drain(session, state, trainer)
        self.hook = None

    def _after_drain(self, session, done: list, refresh: bool) -> None:
        """Snapshots kept only for these jobs may go now: ``best`` and retention refreshed (coordinator)."""
        if refresh and session is not None and session.is_open:
            session.committer.after_commit(None)
