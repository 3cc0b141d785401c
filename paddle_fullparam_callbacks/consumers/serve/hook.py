"""The coordinator's line of swaps: each committed snapshot offered to every engine of ``serve.url``.

It is a consumer (``../hook.py``: the line, the worker thread, drain, adoption); what is its own:
:meth:`ServeHook.committed` puts a snapshot in line; the worker thread takes the newest (the others waiting
are recorded as skipped: an engine needs only the newest weights), writes the ``running`` record and hands it to the
job's swap agent (``agent.py``: one process in a session of its own, started with the hook, which verifies the
snapshot, so that one that fails verification is never sent, and swaps it into the engines; a swap outlives a
training job that is killed, never leaves an engine paused, and costs no process start); the final record says,
per engine, what it serves now and each call's seconds. The hook keeps what each engine served last for sure
(:class:`EngineState`): the fallback of its next swap, which retention keeps (:meth:`busy`). A swap that
runs is never stopped at the end of training (its calls are bounded by their timeouts); :meth:`wait_for` is
``serve.wait``'s.

``serve.adapter`` (a LoRA run): each swap loads the snapshot's adapter under the names ``adapters.py`` gives, and
the state is what each engine holds (:class:`~.adapters.Held`), all of which retention keeps. With ``holds``
(``evaluate.lm_eval.engine_hold``), the next swap waits while an engine serves a snapshot whose evaluation is not
over (:meth:`_blocked`); ``serve.wait`` then returns at once (the hold delays swaps, never training).
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ...config.schema import ServeConfig
from ...config.serving import format_engine_path, swap_bound_s
from ...export.commit.ownership import delete_marked, is_marked, snapshot_identity
from ...export.write.fsync import write_json_durable
from ... import _faults
from ..holds import Holds
from ..hook import BACKSTOP_S, ConsumerHook, Job, LandingQueue, not_recordable
from . import adapters, records
from .agent import OUTPUT, SPEC
from .agent_client import Agent, agent_works, prepare_work
from .engines import Target
from .result import final_entries

__all__ = ["EngineState", "ServeHook", "Serving", "agent_works", "prepare_work"]


def job_timeout(cfg: ServeConfig) -> float:
    """How long the hook waits for the agent's answer (beyond it, a backstop): the most one swap can take."""
    return swap_bound_s(cfg.timeout_s, cfg.reload_timeout_s)


@dataclass
class _Bounds:
    """What the hook base reads of a consumer's config: a job's bound (and a CPU priority, unused here)."""

    timeout_s: float
    nice: int = 0  # a swap mostly waits on the engines; its latency is the point


@dataclass
class EngineState:
    """What the hook knows of one engine: the weights it served last for sure (the next swap's fallback)."""

    url: str
    served: Optional[Target] = None
    snapshot: Optional[str] = None  # the name of that snapshot when it is one of output_dir's
    held: adapters.Held = field(default_factory=adapters.Held)  # adapter mode: the adapters it holds

    def serves(self) -> Optional[str]:
        """The snapshot requests get now (weights mode: the weights; adapter mode: the stable name's adapter)."""
        return self.held.stable or (self.served.version if self.served else None)


@dataclass
class Serving(Job):
    """One snapshot's swap on every engine (``record``: the summary, with ``engines``: {url: entry})."""

    in_output_dir: bool = True
    committed_unix: float = field(default_factory=time.time)
    targets: Dict[str, Target] = field(default_factory=dict)

    @property
    def kept(self) -> bool:
        return self.in_output_dir

    @property
    def entries(self) -> Dict[str, dict]:
        return (self.record or {}).get("engines") or {}


class ServeHook(ConsumerHook):
    """Offers the committed snapshots of ``output_dir`` to the engines of ``config.serve`` (the coordinator's)."""

    THREAD, FAULT, WHO = "pfc-serve", "serve_running", "the serving hook"
    WORKDIR, LOG = records.WORKDIR, records.LOG
    POLL_S = 0.2
    STOP_RUNNING = False  # a swap is never cut between its pause and its resume
    DONE = OUTPUT

    def __init__(self, cfg: ServeConfig, states: Dict[str, EngineState], run_id: str, skip_behind: bool = True,
                 holds: Optional[Holds] = None):
        super().__init__(_Bounds(job_timeout(cfg)), run_id, workers=1, skip_behind=skip_behind)
        self.serve = cfg
        self.states = states
        self.holds = holds
        self._skipped: List[Serving] = []
        self._landed: Dict[str, threading.Event] = {}
        self._done = LandingQueue(self._mark_landed)
        self.agent = Agent()
        self.agent.start()  # imports the package's verification now, before the job's first step
        self._why: Dict[str, str] = {}  # a job's swap that gave no output: why (the agent lost)
        if holds is not None:
            holds.on_release(self._wake)

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int, in_output_dir: bool = True) -> Serving:
        """A snapshot was committed: it goes in line (the training thread's, or a background commit's: no I/O)."""
        job = Serving(name, Path(path).resolve(), int(step), in_output_dir=in_output_dir)
        with self._cond:
            self._landed[name] = threading.Event()
        self.submit(job)
        return job

    def wait_for(self, name: str, timeout_s: float) -> bool:
        """Block until the swap of snapshot ``name`` has ended (served, failed, skipped), or waits behind a hold
        (``held_back`` says which); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            event = self._landed.get(name)
            while event is not None and not event.is_set() and not self.held_back(name):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def held_back(self, name: str) -> bool:
        """(The lock held) whether snapshot ``name`` waits in line behind a hold."""
        return any(j.name == name for j in self._line) and self._blocked()

    def _mark_landed(self, job: Job) -> None:
        with self._cond:
            event = self._landed.pop(job.name, None)
            if event is not None:
                event.set()
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _blocked(self) -> bool:
        """An engine serves a snapshot whose evaluation is not over (``evaluate.lm_eval.engine_hold``); a swap an
        earlier job left running is watched whatever holds."""
        if self.holds is None or any(j.adopted for j in self._line):
            return False
        return any(self.holds.held(n) for n in (s.serves() for s in self.states.values()) if n)

    def busy(self):
        """Snapshots in line, being swapped or not drained, each engine's fallback and every snapshot whose adapter
        an engine holds (retention keeps them)."""
        with self._cond:
            served = {s.snapshot for s in self.states.values() if s.snapshot}
            for s in self.states.values():
                served |= s.held.kept()
        return super().busy() | served

    def _enqueue(self, job: Serving) -> bool:
        self._line = [j for j in self._line if j.name != job.name]  # re-exported: the new commit only
        self._line.append(job)
        return True

    # ---- the worker thread -------------------------------------------------------------------
    def _take(self) -> Optional[Serving]:
        """The newest snapshot (the lock held); the others waiting are recorded as skipped. A swap an earlier
        job left running is watched first."""
        for job in self._line:
            if job.adopted:
                self._line.remove(job)
                return job
        first, superseded = self._newest_wins()
        for job in superseded:
            job.record = {**self._base(job), "status": records.SKIPPED,
                          "error": f"serving fell behind and a newer snapshot won ({first.name} is served instead)"}
            self._skipped.append(job)
        return first

    def _run(self, job: Serving) -> None:
        with self._cond:
            skipped, self._skipped = self._skipped, []
        for s in skipped:  # recorded here, outside the lock
            self._keep(s, s.record)
            self._done.put(s)
        super()._run(job)

    def _base(self, job: Serving) -> dict:
        return {"snapshot": job.name, "step": job.step, "run": self.run_id}

    def _write(self, job: Serving, record: dict) -> None:
        """Per engine: the record's own entries, or the same entry for every engine (running, skipped...)."""
        entries = record.get("engines")
        if entries is None:
            entries = {url: {**record, "engine": url} for url in self.serve.urls}
        records.write(job.path, entries)

    def _keep(self, job: Serving, record: dict) -> dict:
        if snapshot_identity(job.path) is not None:
            try:
                self._write(job, record)
            except OSError as e:
                record["error"] = f"{record.get('error') or ''} (the record could not be written: {e})".strip()
        return record

    def _start(self, job: Serving) -> None:
        if self._closing.is_set():
            job.record = self._unstarted(job, self._waited_s or 0.0)
            return
        identity = snapshot_identity(job.path)
        if identity is None:
            job.record = {**self._base(job), "status": records.FAILED,
                          "error": "the snapshot is gone (removed before it could be served)"}
            return
        work = prepare_work(job.path, self.run_id)
        engines = self._engines(job)
        write_json_durable(work / SPEC, {"snapshot": str(job.path), "engine": self.serve.engine,
                                         "api_key_env": self.serve.api_key_env, "verify": self._verify,
                                         "timeout_s": self.serve.timeout_s, "log": str(job.path / records.LOG),
                                         "reload_timeout_s": self.serve.reload_timeout_s, "engines": engines})
        job.running = {**self._base(job), "status": records.RUNNING, "committed_unix": job.committed_unix,
                       "host": socket.gethostname(), "pid": self.agent.start(), "started_unix": time.time(),
                       "timeout_s": self.cfg.timeout_s, "log": records.LOG, "identity": identity,
                       "engine_paths": {u: t.path for u, t in job.targets.items()}}
        self._write(job, job.running)
        _faults.point(self.FAULT)
        why = self.agent.run(work, self.cfg.timeout_s + BACKSTOP_S)
        if why:
            self._why[job.name] = why
        self._finalize(job)

    @property
    def _verify(self) -> str:
        """What the agent verifies before a swap: the files the engines will read."""
        return adapters.DIRECTORY if self.serve.adapter else "snapshot"

    def _engines(self, job: Serving) -> List[dict]:
        """The swap agent's spec per engine (``job.targets`` filled in): the snapshot's weights and the fallback,
        or, in adapter mode, the adapter's load (:func:`~.adapters.plan`)."""
        out = []
        with self._cond:
            states = {url: (s.served, s.held) for url, s in self.states.items()}
        for url in self.serve.urls:
            path = format_engine_path(self.serve.path_template, str(job.path), job.name, job.step)
            fallback, held = states.get(url, (None, adapters.Held()))
            if self.serve.adapter:
                load = adapters.plan(held, job.name, adapters.adapter_path(path), self.serve.adapter_name,
                                     self.serve.keep_adapters)
                job.targets[url] = Target(load.path, job.name)
                out.append({"url": url, "adapter": vars(load)})
            else:
                job.targets[url] = Target(path, job.name)
                out.append({"url": url, "target": vars(job.targets[url]),
                            "fallback": vars(fallback) if fallback else None})
        return out

    def _finalize(self, job: Serving) -> None:
        work = job.path / records.WORKDIR
        running = job.running or self._base(job)
        if not job.targets:  # adopted: the engines' paths are in its running record
            job.targets = {u: Target(p, job.name) for u, p in (running.get("engine_paths") or {}).items()}
        entries = final_entries(running, self.serve.urls, job.targets, work / OUTPUT, self._why.pop(job.name, None))
        ok = all(e["status"] == records.OK for e in entries.values())
        job.record = {**self._base(job), "status": records.OK if ok else records.FAILED, "engines": entries}
        self._learn(job)
        if not_recordable(job.record, job.path, running, "served"):
            return
        self._write(job, job.record)
        if work.is_dir() and is_marked(work):
            delete_marked(work)

    def _learn(self, job: Serving) -> None:
        """Each engine's state after the swap: a served snapshot is its next fallback (after a failed swap the
        fallback stays the last weights it served for sure, whatever it serves now)."""
        with self._cond:
            for url, entry in job.entries.items():
                state = self.states.setdefault(url, EngineState(url))
                if self.serve.adapter:  # what it holds, whatever the outcome: the loads and unloads that happened
                    state.held = adapters.learn(state.held, job.name, self.serve.adapter_name,
                                                entry.get("loaded") or [], entry.get("unloaded") or [])
                    entry.update(mode="adapter", adapter=self.serve.adapter_name,
                                 adapters=state.held.names(self.serve.adapter_name))
                elif entry["status"] == records.OK:
                    state.served = job.targets[url]
                    state.snapshot = job.name if job.in_output_dir else None

    def alive(self, running: dict, work: Path) -> bool:
        return agent_works(running, work)

    def close(self, wait_s: float) -> None:
        super().close(wait_s)
        self.agent.close()

    def _unstarted(self, job: Serving, waited: float) -> dict:
        return self._keep(job, {**self._base(job), "status": records.UNFINISHED,
                                "error": f"not served: the training ended first (after waiting {waited:.0f} s, "
                                         "serve.wait_at_end_s)"})
