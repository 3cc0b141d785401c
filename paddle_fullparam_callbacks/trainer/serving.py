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
from ..consumers.holds import Holds
from ..consumers.serve import adapters
from ..consumers.serve.adapter_start import CONFIG_FILE, RunAdapter
from ..export.session.companions import companion_layout
from ..models.lora import LoraError
from ..models.lora.serving import adapter_mode_problem, base_logprobs, probe_ids
from ..models.model_info import unwrap_model
from .consumers import TrainerConsumer, log_row, snapshot_label

logger = logging.getLogger("paddle_fullparam_callbacks")
__all__ = ["ServeStartFailed", "TrainerServing", "describe"]


def planned_model(source, prepared) -> tuple:
    """(architecture, {tensor: shape}) of the job's snapshots, from its plan: what an engine's model must be."""
    archs = (source.hf_config or {}).get("architectures") if source is not None else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    return arch, {name: tuple(slot.shape) for name, slot in prepared.plan.slots.items()}


def engine_holds(config: FullParamConfig) -> Optional[Holds]:
    """The holds that make swaps wait for the engine backend's evaluations (``evaluate.lm_eval.engine_hold``), or
    None (no such evaluations, or the hold is off)."""
    lm = config.evaluate.lm_eval
    return Holds() if config.serve.enabled and lm.enabled and lm.backend == "engine" and lm.engine_hold else None


def adapter_source(build, config: FullParamConfig):
    """``build()`` (the model's export source); with ``serve.adapter``, an adapter the export cannot write (a layout
    or a variant peft cannot describe) is refused naming that key, the mode that asked for the adapter."""
    try:
        return build()
    except LoraError as e:
        if not config.serve.adapter:
            raise
        why = str(e).removesuffix("; set export.peft_adapter=none")
        raise ConfigError("serve.adapter", f"its adapter cannot be written as a PEFT adapter: {why}; such a run cannot "
                                           "be served as adapters: serve.adapter=false reloads each snapshot's merged "
                                           "weights instead") from e


def adapter_run(ctx, source, prepared, model) -> tuple:
    """``serve.adapter``, on every rank: (a failure to share, or None; the run's adapter on the coordinator).
    What each rank's model allows (``models/lora/serving.py``), the adapter's tensors and config as its export will
    write them (one exchange in the coordinator's mesh), and, where this process holds the whole model, the run's
    base log-probabilities."""
    problem = adapter_mode_problem(unwrap_model(model), alone=ctx.is_coordinator) if model is not None else \
        "no model was given to the callback"
    if problem:
        return ("config", "serve.adapter", problem), None
    companion = next((c for c in (source.companions if source else []) if c.directory == adapters.DIRECTORY), None)
    if companion is None:
        return ("config", "serve.adapter", "the export writes no PEFT adapter for this model"), None
    try:
        layout = companion_layout(ctx, prepared, companion)
    except LoraError as e:
        return ("config", "serve.adapter", f"its adapter cannot be written as a PEFT adapter: {e}"), None
    if not ctx.is_coordinator or layout is None:
        return None, None
    dmap, files = layout
    config = files[CONFIG_FILE]
    run = RunAdapter(int(config["r"]), {t.name: (tuple(t.shape), t.dtype) for t in dmap.specs}, config)
    if ctx.mesh.size == 1:  # the whole model is in this process: its base forward needs no other rank
        vocab = int((source.hf_config or {}).get("vocab_size") or 256)
        run.ids = probe_ids(source.tokenizer, vocab)
        try:
            run.logprobs = base_logprobs(unwrap_model(model), run.ids)
        except Exception as e:  # e.g. out of memory: the base is still checked by its names and shapes
            logger.warning("serve.adapter: the run's base forward for the engines' base check failed (%s: %s); the "
                           "engines' base is checked by its names and shapes only", type(e).__name__, e)
    else:
        logger.info("serve.adapter: the model is split over %d ranks here, so the engines' base is checked by its "
                    "names and shapes only (not by its log-probabilities)", ctx.mesh.size)
    return None, run


class TrainerServing(TrainerConsumer):
    """What the callback keeps of serving: the hook (coordinator), every finished swap, the start's probes."""

    KEY, JOBS = "serve", "swap(s)"

    def __init__(self, config: FullParamConfig, holds: Optional[Holds] = None):
        super().__init__(config)
        self.holds = holds
        self.hook: Optional[ServeHook] = None
        self.probes: Dict = {}
        self._failing: Set[str] = set()  # engines whose failure was logged, until they serve again

    def check(self, ctx, source, prepared, model=None, session=None) -> None:
        """Every rank, once the plan is made (before step 1): the coordinator proves every engine (``serve.adapter``:
        first every rank's model, then the run's adapter on every engine); one exchange shares a failure, raised on
        every rank (ServeStartFailed for what an engine lacks, else ConfigError; each names its recipe key)."""
        if not self.enabled:
            return
        failure, run = None, None
        if self.section.adapter:
            failure, run = adapter_run(ctx, source, prepared, model)
        if ctx.is_coordinator and failure is None:
            try:
                if not self.section.adapter and source is not None and source.notes.get("lora"):
                    logger.info("serve: a LoRA run, served by reloading each snapshot's weights into the engines; "
                                "serve.adapter=true loads only its adapter, in milliseconds, into engines started "
                                "with LoRA (docs/serving.md)")
                self.probes = prove_engines(self.section, planned_model(source, prepared), adapter=run,
                                            output_dir=session.output_dir if session else None,
                                            run_id=session.run_id if session else "start")
            except ServeStartFailed as e:
                failure = ("engine", e.key, str(e)[len(e.key) + 2:])
            except ConfigError as e:
                failure = ("config", e.key, str(e)[len(e.key) + 2:])
        failures = ctx.all_gather_object(failure, what="serve probe")
        failure = failures[ctx.coordinator] or next((f for f in failures if f), None)
        if failure:
            kind, key, message = failure
            raise ServeStartFailed(key, message) if kind == "engine" else ConfigError(key, message)

    def start(self, session) -> None:
        """Coordinator: the hook on the session's commits (beside the other consumers'), what earlier jobs'
        swaps left settled, and the newest snapshot offered at once to an engine left paused."""
        if not self.enabled or not session.ctx.is_coordinator:
            return
        cfg = self.section
        hook = ServeHook(cfg, initial_states(cfg, self.probes, session.output_dir), session.run_id, holds=self.holds)

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
            logger.info("served %s on %s", job.name, "; ".join(f"{u} ({_how(entries[u])} "
                                                              f"{entries[u].get('served_s', 0):.2f} s after the commit)"
                                                              for u in ok))
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


def _how(entry: dict) -> str:
    """What a served entry did: the reload of the weights, or the adapter's load under its names."""
    if entry.get("mode") == "adapter":
        return f"adapter as {', '.join(entry.get('loaded') or [])}, load {entry.get('load_s', 0):.3f} s, served"
    return f"reload {entry.get('reload_s', 0):.2f} s, served"


def describe(job: Serving) -> str:
    record = job.record or {}
    parts = [f"{u}: {e.get('status')}" + (f" ({e.get('error')})" if e.get("error") else "")
             for u, e in job.entries.items()]
    return "; ".join(parts) or f"{record.get('status')}: {record.get('error')}"
