"""The callback's side of the publisher (``consumers/publish/``): proven at start, drained, finished.

Only the coordinator publishes (its Committer commits every snapshot). At ``on_train_begin`` it proves the
store usable (``probe``: write, read back, delete under the prefix; the conditional headers honoured),
and one exchange shares a failure, so that every rank stops alike with the store's own error and the URL
before step 1. Finished publications are collected on the training thread at the next trainer event: a
failure or a skip is logged once (the record beside the snapshot keeps the details), and when ``best``
has moved to a snapshot the store already holds, the store's ``best`` follows.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import List, Optional

from ..config.schema import FullParamConfig
from ..export.commit.pointers import read_pointer
from ..export.commit.retention import list_snapshots
from ..consumers.publish.hook import Publication, PublishHook
from ..consumers.publish.recovery import recover
from .consumers import TrainerConsumer, log_row

logger = logging.getLogger("paddle_fullparam_callbacks")


class PublishStartFailed(RuntimeError):
    """The store cannot be used (raised on every rank, before the first step)."""


class TrainerPublishing(TrainerConsumer):
    """What the callback keeps of the publisher: the hook (coordinator) and every finished publication."""

    KEY, JOBS = "publish", "publication(s)"

    def __init__(self, config: FullParamConfig):
        super().__init__(config)
        self.hook: Optional[PublishHook] = None
        self.warnings: List[str] = []
        self._best: Optional[str] = None

    def check(self, ctx) -> None:
        """Every rank, before the session starts: the coordinator probes the store; one exchange shares the outcome."""
        if not self.enabled:
            return
        failure = None
        if ctx.is_coordinator and self.config.publish.url:
            from ..consumers.publish.probe import ProbeFailed, probe
            from ..consumers.publish.store import Store, StoreError

            try:
                self.warnings = probe(Store(self.config.publish, retries=min(self.config.publish.retries, 2)),
                                      self.config.publish.require_conditional_writes)
            except (ProbeFailed, StoreError, ValueError) as e:
                failure = str(e)
            for w in self.warnings:
                logger.warning("%s", w)
        failure = ctx.all_gather_object(failure, what="publish probe")[ctx.coordinator]
        if failure:
            raise PublishStartFailed(failure)

    def start(self, session) -> None:
        """Coordinator: the hook on the session's commits (beside the evaluation hook's), and what earlier
        jobs' publications left settled or resumed."""
        if not self.enabled or not session.ctx.is_coordinator:
            return
        hook = PublishHook(self.config, session.output_dir, session.run_id)

        def publication(job) -> None:
            if job.pointers:  # the checkpoint hook's snapshots (checkpoint-N/hf) stay local
                hook.committed(job.name, Path(job.out_dir) / job.name, job.step)

        self.connect(session.committer, publication, hook.busy)
        found = [(e.name, e.step, e.path, e.run) for e in list_snapshots(session.output_dir, session.pattern)]
        left = recover(hook, found, hook.destination, session.run_id)
        for pub in left["settled"]:
            logger.info("publication of %s, left by an earlier job, recorded at this start: %s", pub.name, pub.status)
        self.results.extend(left["settled"])
        if left["adopted"] or left["todo"]:
            logger.info("publications an earlier job left are %s: %s",
                        "watched and finished", ", ".join(p.name for p in left["adopted"] + left["todo"]))
        self._best = read_pointer(session.output_dir, "best")
        self.hook = hook

    def drain(self, session, state, trainer=None) -> List[Publication]:
        """The training thread, at an event: log what finished (failures and skips once); follow ``best``."""
        if self.hook is None:
            return []
        done = self.hook.drain()
        for pub in done:
            if pub.kind != "snapshot":
                if pub.status != "ok":
                    logger.warning("publishing: updating the store (%s) failed: %s", pub.kind, (pub.entry or {}).get("error"))
                continue
            self.results.append(pub)
            self._log(pub, state, trainer)
        self._after_drain(session, done, any(p.kind == "snapshot" for p in done))
        if session is not None and session.is_open:
            best = read_pointer(session.output_dir, "best")
            if best != self._best:
                self._best = best
                self.hook.refresh_pointers()
        return done

    def _log(self, pub: Publication, state, trainer) -> None:
        entry = pub.entry or {}
        if pub.status == "ok":
            result = entry.get("result") or {}
            logger.info("published %s (step %d) to %s%s", pub.name, pub.step,
                        result.get("url") or self.config.publish.url or self.config.publish.command, f" ({result['bytes'] / 1e6:.1f} MB in {result.get('seconds', 0):.1f} s)" if "bytes" in result else "")
            row = {"fullparam/publish/step": float(pub.step)}
        else:
            logger.warning("publication of %s (step %d) %s: %s (log: %s); training continues, the snapshot stays",
                           pub.name, pub.step, pub.status, entry.get("error"), pub.path / "fullparam_publish.log")
            row = {f"fullparam/publish/{pub.status}": float(pub.step)}
        log_row(row, state, trainer)

    def _before_close(self, session, state, trainer) -> None:
        self.drain(session, state, trainer)  # the last evaluations may have moved best
