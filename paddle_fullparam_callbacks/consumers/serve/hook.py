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
"""
from __future__ import annotations

import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ...config.schema import ServeConfig
from ...config.serving import format_engine_path, swap_bound_s
from ...export.commit.ownership import delete_marked, is_marked, mark, snapshot_identity
from ...export.write.fsync import write_json_durable
from ... import _faults
from ..hook import BACKSTOP_S, ConsumerHook, Job, not_recordable
from ..runner import cmdline
from . import records
from .agent import OUTPUT, SPEC
from .engines import Target
from .result import final_entries

AGENT = Path(__file__).resolve().with_name("agent.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding paddle_fullparam_callbacks/


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


class Agent:
    """The hook's swap agent (``agent.py``): started with the hook in a session of its own (it imports the
    package's verification meanwhile), told one work folder at a time, answering when that swap has ended;
    started again after it died or stopped answering."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self._ready = False

    def start(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-I", str(AGENT), PACKAGE_ROOT], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, start_new_session=True)
            self._ready = False
        return self.proc.pid

    def run(self, work: Path, timeout_s: float) -> Optional[str]:
        """Hand ``work`` to the agent; None once it answered, else why not (it died, or gave no answer within
        ``timeout_s``: then it is killed, and the next swap starts another)."""
        proc = self.proc
        deadline = time.monotonic() + timeout_s
        if not self._ready:  # its first line: the package imported (one start's cost, before any swap)
            why = self._line(deadline, timeout_s)
            if why:
                return why
            self._ready = True
        try:
            proc.stdin.write(f"{work}\n".encode())
            proc.stdin.flush()
        except OSError as e:
            return self._lost(f"the swap agent could not be reached ({e})")
        return self._line(deadline, timeout_s)

    def _line(self, deadline: float, timeout_s: float) -> Optional[str]:
        """Read one answer line; None, or why there is none."""
        answer, fd = b"", self.proc.stdout.fileno()
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return self._lost(f"the swap agent gave no answer within {timeout_s:.0f} s", kill=True)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1)  # one byte at a time: never past this answer's line
                if not chunk:
                    return self._lost(f"the swap agent ended (exit status {self.proc.wait()})")
                answer += chunk
        return None

    def _lost(self, why: str, kill: bool = False) -> str:
        if kill and self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        return why

    def close(self) -> None:
        """No more swaps: the agent sees its input closed and exits."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self.proc = None


def agent_works(running: dict, work: Path) -> bool:
    """Whether the swap agent of a running record still works on ``work`` (on this host: ``/proc``)."""
    if running.get("host") not in (None, socket.gethostname()):
        return False
    args = cmdline(running.get("pid"))
    return any(arg.endswith(AGENT.name.encode()) for arg in args) and not (work / OUTPUT).exists()


class _DoneQueue(queue.Queue):
    """The done queue, telling :meth:`ServeHook.wait_for` of every job that lands in it."""

    def __init__(self, landed):
        super().__init__()
        self._landed = landed

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self._landed(item)


class ServeHook(ConsumerHook):
    """Offers the committed snapshots of ``output_dir`` to the engines of ``config.serve`` (the coordinator's)."""

    THREAD, FAULT, WHO = "pfc-serve", "serve_running", "the serving hook"
    WORKDIR, LOG = records.WORKDIR, records.LOG
    POLL_S = 0.2
    STOP_RUNNING = False  # a swap is never cut between its pause and its resume
    DONE = OUTPUT

    def __init__(self, cfg: ServeConfig, states: Dict[str, EngineState], run_id: str, skip_behind: bool = True):
        super().__init__(_Bounds(job_timeout(cfg)), run_id, workers=1, skip_behind=skip_behind)
        self.serve = cfg
        self.states = states
        self._skipped: List[Serving] = []
        self._landed: Dict[str, threading.Event] = {}
        self._done = _DoneQueue(self._mark_landed)
        self.agent = Agent()
        self.agent.start()  # imports the package's verification now, before the job's first step
        self._why: Dict[str, str] = {}  # a job's swap that gave no output: why (the agent lost)

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int, in_output_dir: bool = True) -> Serving:
        """A snapshot was committed: it goes in line (the training thread's, or a background commit's: no I/O)."""
        job = Serving(name, Path(path).resolve(), int(step), in_output_dir=in_output_dir)
        with self._cond:
            self._landed[name] = threading.Event()
        self.submit(job)
        return job

    def wait_for(self, name: str, timeout_s: float) -> bool:
        """Block until the swap of snapshot ``name`` has ended (served, failed, skipped); False on timeout."""
        with self._cond:
            event = self._landed.get(name)
        return True if event is None else event.wait(timeout_s)

    def _mark_landed(self, job: Job) -> None:
        with self._cond:
            event = self._landed.pop(job.name, None)
        if event is not None:
            event.set()

    def busy(self):
        """Snapshots in line, being swapped or not drained, and each engine's fallback (retention keeps them)."""
        with self._cond:
            served = {s.snapshot for s in self.states.values() if s.snapshot}
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
        with self._cond:
            states = {url: s.served for url, s in self.states.items()}
        engines = []
        for url in self.serve.urls:
            target = Target(format_engine_path(self.serve.path_template, str(job.path), job.name, job.step), job.name)
            job.targets[url] = target
            fallback = states.get(url)
            engines.append({"url": url, "target": vars(target), "fallback": vars(fallback) if fallback else None})
        write_json_durable(work / SPEC, {"snapshot": str(job.path), "engine": self.serve.engine,
                                         "api_key_env": self.serve.api_key_env,
                                         "timeout_s": self.serve.timeout_s, "log": str(job.path / records.LOG),
                                         "reload_timeout_s": self.serve.reload_timeout_s, "engines": engines})
        job.running = {**self._base(job), "status": records.RUNNING, "committed_unix": job.committed_unix,
                       "host": socket.gethostname(), "pid": self.agent.start(), "started_unix": time.time(), "timeout_s": self.cfg.timeout_s, "log": records.LOG,
                       "identity": identity, "engine_paths": {u: t.path for u, t in job.targets.items()}}
        self._write(job, job.running)
        _faults.point(self.FAULT)
        why = self.agent.run(work, self.cfg.timeout_s + BACKSTOP_S)
        if why:
            self._why[job.name] = why
        self._finalize(job)

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
                if entry["status"] == records.OK:
                    state = self.states.setdefault(url, EngineState(url))
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


def prepare_work(snapshot: Path, run_id: str) -> Path:
    """The snapshot's marked work folder for its swap (an earlier attempt's files removed)."""
    work = snapshot / records.WORKDIR
    if work.exists() or work.is_symlink():
        if not (work.is_dir() and not work.is_symlink() and is_marked(work)):
            raise FileExistsError(f"{work} exists and is not this package's; left alone")
        delete_marked(work)
    work.mkdir()
    mark(work, run_id)
    return work
