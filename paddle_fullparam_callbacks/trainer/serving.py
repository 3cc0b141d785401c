"""The callback's side of serving (``consumers/serve/``): proven at start, drained, waited for, finished.

Only the coordinator drives the engines (its Committer commits every snapshot). Once the plan is made, before
step 1, it proves every engine (``probe``: it answers, has the endpoints a swap needs, serves a model the
snapshots fit), and one exchange shares a failure, so that every rank stops alike, naming ``serve.url``.
Finished swaps are collected on the training thread at the next trainer event: a line per served snapshot,
an engine's failure logged once (until it serves again), the record beside the snapshot keeping the details.
With ``serve.wait`` an export returns once every engine serves its snapshot (every rank, together).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Optional, Set

from ..config.schema import ConfigError, FullParamConfig
from ..config.serving import VERIFY_ALLOWANCE_S, swap_bound_s
from ..export.commit.pointers import read_pointer
from ..export.commit.retention import list_snapshots
from ..consumers.serve import records
from ..consumers.serve.engines.base import UNKNOWN
from ..consumers.serve.hook import ServeHook, Serving
from ..consumers.serve.probe import ServeStartFailed, initial_states, prove_engines
from ..consumers.serve.recovery import recover
from .consumers import TrainerConsumer, log_row, snapshot_label

logger = logging.getLogger("paddle_fullparam_callbacks")
__all__ = ["ServeStartFailed", "TrainerServing", "describe"]


def planned_model(source, prepared) -> tuple:
    """(architecture, {tensor: shape}) of the job's snapshots, from its plan: what an engine's model must be."""
    archs = (source.hf_config or {}).get("architectures") if source is not None else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch, {name: tuple(slot.shape) for name, slot in prepared.plan.slots.items()}


class TrainerServing(TrainerConsumer):
    """What the callback keeps of serving: the hook (coordinator), every finished swap, the start's probes."""

    KEY, JOBS = "serve", "swap(s)"

    def __init__(self, config: FullParamConfig):
        super().__init__(config)
        self.hook: Optional[ServeHook] = None
        self.probes: Dict = {}
        self._failing: Set[str] = set()  # engines whose failure was logged, until they serve again

    def check(self, ctx, source, prepared) -> None:
        """Every rank, once the plan is made (before step 1): the coordinator proves every engine; one exchange
        shares a failure, raised on every rank (ConfigError for a recipe key, else ServeStartFailed)."""
        if not self.enabled:
            return
        failure = None
        if ctx.is_coordinator:
            try:
                self.probes = prove_engines(self.section, planned_model(source, prepared))
            except ConfigError as e:
                failure = ("config", e.key, str(e)[len(e.key) + 2:])
            except ServeStartFailed as e:
                failure = ("engine", None, str(e))
        failure = ctx.all_gather_object(failure, what="serve probe")[ctx.coordinator]
        if failure:
            kind, key, message = failure
            raise ConfigError(key, message) if kind == "config" else ServeStartFailed(message)

    def start(self, session) -> None:
        """Coordinator: the hook on the session's commits (beside the other consumers'), what earlier jobs'
        swaps left settled, and the newest snapshot offered at once to an engine left paused."""
        if not self.enabled or not session.ctx.is_coordinator:
            return
        cfg = self.section
        hook = ServeHook(cfg, initial_states(cfg, self.probes, session.output_dir), session.run_id)

        def swap(job) -> None:
            hook.committed(snapshot_label(job), Path(job.out_dir) / job.name, job.step, in_output_dir=job.pointers)

        self.connect(session.committer, swap, hook.busy)
        found = list_snapshots(session.output_dir, session.pattern)
        left = recover(hook, [(e.name, e.step, e.path) for e in found], cfg.urls)
        for job in left["settled"]:
            logger.info("serving of %s, left by an earlier job, recorded at this start: %s", job.name, describe(job))
        self.results.extend(left["settled"])
        paused = [url for url, p in self.probes.items() if p.paused]
        newest = read_pointer(session.output_dir, "latest")
        if paused and newest and not left["adopted"]:
            logger.warning("serve: %s %s paused (an earlier swap was interrupted?): offering the newest snapshot %s "
                           "now", ", ".join(paused), "is" if len(paused) == 1 else "are", newest)
            entry = next((e for e in found if e.name == newest), None)
            if entry is not None:
                hook.committed(entry.name, entry.path, entry.step)
        self.hook = hook

    def wait(self, ctx, name: Optional[str]) -> None:
        """``serve.wait``: every rank returns once the coordinator has seen snapshot ``name`` served (or failed)."""
        if not (self.enabled and self.section.wait and name):
            return
        served = None
        if self.hook is not None:
            bound = swap_bound_s(self.section.timeout_s, self.section.reload_timeout_s) + VERIFY_ALLOWANCE_S
            served = self.hook.wait_for(name, bound)
            if not served:
                logger.warning("serve.wait: %s is not served after %.0f s; training goes on", name, bound)
        ctx.all_gather_object(served, what="serve wait")

    def drain(self, session, state, trainer=None) -> List[Serving]:
        """The training thread, at an event: a line per served snapshot, an engine's failure once."""
        if self.hook is None:
            return []
        done = self.hook.drain()
        for job in done:
            self.results.append(job)
            self._log(job, state, trainer)
        self._after_drain(session, done, any(job.in_output_dir for job in done))
        return done

    def _log(self, job: Serving, state, trainer) -> None:
        record = job.record or {}
        entries = job.entries
        if record.get("status") == records.SKIPPED:
            logger.info("serve: %s skipped: %s", job.name, record.get("error"))
            return
        ok = [u for u, e in entries.items() if e["status"] == records.OK]
        if ok:
            logger.info("served %s on %s", job.name, "; ".join(f"{u} (reload {entries[u].get('reload_s', 0):.2f} s, "
                                                              f"served {entries[u].get('served_s', 0):.2f} s after "
                                                              "the commit)" for u in ok))
        for url in ok:
            if url in self._failing:
                self._failing.discard(url)
                logger.info("serve: %s serves again (%s)", url, job.name)
        failed = {u: e for u, e in entries.items() if e["status"] != records.OK}
        if not entries and record.get("status") != records.OK:  # the hook failed before any engine
            failed = {u: record for u in self.section.urls}
        for url, entry in failed.items():
            if url not in self._failing:
                self._failing.add(url)
                now = entry.get("version") or "the weights it served before"
                logger.warning("serve: %s did not take %s (%s): %s; it serves %s; training continues, the next "
                               "snapshot tries again (log: %s)", url, job.name, entry.get("status"), entry.get("error"),
                               "unknown weights" if now == UNKNOWN else now, job.path / records.LOG)
        row = {"fullparam/serve/step": float(job.step), "fullparam/serve/engines_ok": float(len(ok))}
        if ok:
            row["fullparam/serve/served_s"] = max(entries[u].get("served_s", 0.0) for u in ok)
        log_row(row, state, trainer)


def describe(job: Serving) -> str:
    record = job.record or {}
    parts = [f"{u}: {e.get('status')}" + (f" ({e.get('error')})" if e.get("error") else "")
             for u, e in job.entries.items()]
    return "; ".join(parts) or f"{record.get('status')}: {record.get('error')}"
