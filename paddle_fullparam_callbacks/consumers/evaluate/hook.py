"""The evaluation hook: committed snapshots scored in separate processes while training goes on.

Only the coordinator has one (the Committer calls :meth:`EvaluationHook.committed` after each
commit). Nothing of it runs on the training thread but bookkeeping: a commit puts the snapshot in
line (every ``evaluate.every``-th one, and the last one at the end); up to
``evaluate.max_concurrent`` worker threads each start a runner process (``runner.py``: its own
session, lower CPU priority, the evaluator's output to the snapshot's log), write the ``running``
record, wait for the runner, and write the final record; the training thread collects finished
evaluations with :meth:`drain` at its next event (to log the scores through the trainer and
refresh ``best`` and retention, which are the coordinator's file operations, serialised with the
commits). Snapshots in line, running or not yet drained are in :meth:`busy`: retention keeps them.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set

from ... import _faults
from ...config.schema import EvaluateConfig
from ...export.commit import evaluation as records
from ...export.commit.ownership import delete_marked, is_marked, mark, snapshot_identity
from ...export.write.fsync import write_json_durable
from . import result as results
from .command import build_argv, describe
from ..runner import EVALUATOR_PID, KILL_GRACE_S, STATUS, find, is_alive

logger = logging.getLogger("paddle_fullparam_callbacks")

RUNNER = Path(__file__).resolve().parents[1] / "runner.py"  # consumers/runner.py: shared with the publisher
OUTPUT = "output.json"
BACKSTOP_S = 60.0  # beyond evaluate.timeout_s: the hook stops a runner that did not stop itself
STOP_WAIT_S = 15.0  # at the end: how long stopped evaluations get to record themselves as unfinished
POLL_S = 1.0  # how often an adopted runner (an earlier job's, not our child) is looked at


@dataclass
class Evaluation:
    """One snapshot's evaluation, from the line to its final record."""

    name: str  # hf-step-000010, or checkpoint-10/hf for the checkpoint hook's
    path: Path
    step: int
    in_output_dir: bool = True  # retention and best apply to it
    running: Optional[dict] = None  # the running record (an earlier job's, for an adopted runner)
    record: Optional[dict] = None  # the final record
    adopted: bool = False
    proc: Optional[subprocess.Popen] = None
    stopped_after_s: Optional[float] = None
    recovered: bool = False  # finished by an earlier job's runner, recorded at this start
    submitted_unix: float = field(default_factory=time.time)

    @property
    def status(self) -> str:
        return (self.record or {}).get("status", records.RUNNING)

    @property
    def scores(self) -> dict:
        return records.scores_of(self.record)


class EvaluationHook:
    """Runs ``evaluate.command`` / ``evaluate.callable`` on committed snapshots (the coordinator's)."""

    def __init__(self, cfg: EvaluateConfig, python: List[str], run_id: str = "evaluate"):
        self.cfg, self.python, self.run_id = cfg, list(python), run_id
        self._cond = threading.Condition()
        self._line: List[Evaluation] = []
        self._running: Dict[str, Evaluation] = {}
        self._done: "queue.Queue[Evaluation]" = queue.Queue()
        self._undrained: Set[str] = set()
        self._threads: List[threading.Thread] = []
        self._closing = threading.Event()
        self._commits = 0
        self._last: Optional[Evaluation] = None
        self._last_due = False
        self._warned_backlog = False
        self._waited_s: Optional[float] = None  # close(): how long the end of training waited

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int, in_output_dir: bool = True) -> bool:
        """A snapshot was committed (on the training thread, or a background commit's): evaluate it if
        it is an ``evaluate.every``-th one. Returns whether it was put in line."""
        ev = Evaluation(name, Path(path).resolve(), int(step), in_output_dir)
        with self._cond:
            self._commits += 1
            due = bool(self.cfg.every) and self._commits % self.cfg.every == 0
            self._last, self._last_due = ev, due
        if due:
            self.submit(ev)
        return due

    def training_ended(self) -> None:
        """``evaluate.last``: the last committed snapshot is evaluated too, if it was not."""
        with self._cond:
            ev, due, self._last_due = self._last, self._last_due, True
        if ev is not None and not due and self.cfg.last and ev.path.is_dir():
            self.submit(ev)

    def submit(self, ev: Evaluation) -> None:
        with self._cond:
            if self._closing.is_set():
                return
            self._line.append(ev)
            if ev.in_output_dir:
                self._undrained.add(ev.name)
            while len(self._threads) < self.cfg.max_concurrent:
                t = threading.Thread(target=self._work, name=f"pfc-evaluate-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify_all()
            backlog = len(self._line)
        if backlog > 2 * self.cfg.max_concurrent and not self._warned_backlog:
            self._warned_backlog = True
            logger.warning("evaluations fall behind the snapshots: %d wait in line (evaluate.max_concurrent=%d); "
                           "their snapshots are kept until they are evaluated", backlog, self.cfg.max_concurrent)

    def adopt(self, ev: Evaluation) -> None:
        """Watch an evaluation an earlier job left running (its runner is alive): recorded when it ends."""
        ev.adopted = True
        self.submit(ev)

    def busy(self) -> Set[str]:
        """Names (in output_dir) of snapshots waiting, being evaluated or whose result is not drained."""
        with self._cond:
            return set(self._undrained)

    def pending(self) -> int:
        with self._cond:
            return len(self._line) + len(self._running)

    def drain(self) -> List[Evaluation]:
        """Finished evaluations since the last drain (non-blocking; the training thread's)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._cond:
            self._undrained -= {ev.name for ev in out}
        return out

    def close(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the evaluations in line or running; stop the rest and record them
        as unfinished. Their results are then in :meth:`drain`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (self._line or self._running) and deadline - time.monotonic() > 0:
                self._cond.wait(deadline - time.monotonic())
            self._waited_s = wait_s
            self._closing.set()
            left, self._line = self._line, []
            running = list(self._running.values())
            self._cond.notify_all()
        for ev in left:
            ev.record = self._unstarted(ev, wait_s)
            self._done.put(ev)
        for ev in running:
            ev.stopped_after_s = wait_s
            self._signal(ev, signal.SIGTERM)
        end = time.monotonic() + STOP_WAIT_S
        with self._cond:
            while self._running and end - time.monotonic() > 0:
                self._cond.wait(end - time.monotonic())
            stuck = list(self._running.values())
        for ev in stuck:  # a runner that did not stop itself: its record says unfinished anyway
            self._signal(ev, signal.SIGKILL)

    # ---- the workers -------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._line and not self._closing.is_set():
                    self._cond.wait()
                if not self._line:
                    return
                ev = self._line.pop(0)
                self._running[str(ev.path)] = ev
            try:
                self._watch(ev) if ev.adopted else self._evaluate(ev)
            except Exception as e:  # never into training: recorded, logged once at the drain
                ev.record = {**(ev.running or self._base(ev)), "status": records.FAILED,
                             "error": f"the evaluation hook failed: {type(e).__name__}: {e}"}
                self._record_failure(ev)
            finally:
                with self._cond:
                    self._running.pop(str(ev.path), None)
                    self._cond.notify_all()
                self._done.put(ev)

    def _record_failure(self, ev: Evaluation) -> None:
        """A running record already on disk is replaced by the failure (best effort: it says why)."""
        if ev.running is None or snapshot_identity(ev.path) != ev.running.get("identity"):
            return
        try:
            records.write_record(ev.path, ev.record)
            work = ev.path / records.WORKDIR
            if work.is_dir() and is_marked(work):
                delete_marked(work)
        except OSError:
            pass

    def _base(self, ev: Evaluation) -> dict:
        return {"snapshot": ev.name, "step": ev.step, "run": self.run_id}

    def _evaluate(self, ev: Evaluation) -> None:
        if self._closing.is_set():  # taken from the line as the training ended: never started
            ev.record = self._unstarted(ev, self._waited_s or 0.0)
            return
        identity = snapshot_identity(ev.path)
        if identity is None:
            ev.record = {**self._base(ev), "status": records.FAILED,
                         "error": "the snapshot is gone (removed before its evaluation started)"}
            return
        work = ev.path / records.WORKDIR
        if work.exists() or work.is_symlink():
            if not (work.is_dir() and not work.is_symlink() and is_marked(work)):
                raise FileExistsError(f"{work} exists and is not this package's; left alone")
            delete_marked(work)  # an earlier evaluation's, finished (its record is final)
        work.mkdir()
        mark(work, self.run_id)
        output = work / OUTPUT
        argv = build_argv(self.cfg, self.python, ev.path, ev.step, output)
        env = {"PFC_SNAPSHOT": str(ev.path), "PFC_STEP": str(ev.step), "PFC_OUTPUT": str(output)}
        write_json_durable(work / "spec.json", {
            "package": "paddle_fullparam_callbacks", "argv": argv, "env": env, "timeout_s": self.cfg.timeout_s,
            "nice": self.cfg.nice, "log": str(ev.path / records.LOG), "cwd": os.getcwd()})
        with open(work / "runner.err", "wb") as err:
            ev.proc = subprocess.Popen([sys.executable, "-I", str(RUNNER), str(work)], stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        ev.running = {**self._base(ev), "status": records.RUNNING, "command": describe(argv),
                      "host": socket.gethostname(), "pid": ev.proc.pid, "started_unix": time.time(),
                      "timeout_s": self.cfg.timeout_s, "log": records.LOG, "identity": identity}
        records.write_record(ev.path, ev.running)
        _faults.point("evaluate_running")
        if self._closing.is_set():  # started as the training ended: stop it (a second SIGTERM is harmless)
            ev.stopped_after_s = self._waited_s
            self._signal(ev, signal.SIGTERM)
        try:
            ev.proc.wait(timeout=self.cfg.timeout_s + BACKSTOP_S)
        except subprocess.TimeoutExpired:
            self._signal(ev, signal.SIGKILL)
            ev.proc.wait()
        self._finalize(ev)

    def _watch(self, ev: Evaluation) -> None:
        """An earlier job's runner (not our child): look at it every second until it has ended."""
        running, work = ev.running or {}, ev.path / records.WORKDIR
        started = running.get("started_unix") if isinstance(running.get("started_unix"), (int, float)) else time.time()
        deadline = started + float(running.get("timeout_s") or self.cfg.timeout_s) + BACKSTOP_S
        while runner_state(running, work) == "alive" and not (work / STATUS).exists():
            if time.time() > deadline:
                self._signal(ev, signal.SIGKILL)
                break
            if self._closing.wait(POLL_S):
                self._signal(ev, signal.SIGTERM)
                self._closing_wait(running, work)
                break
        self._finalize(ev)

    def _closing_wait(self, running: dict, work: Path) -> None:
        end = time.monotonic() + KILL_GRACE_S + 2
        while runner_state(running, work) == "alive" and not (work / STATUS).exists() and time.monotonic() < end:
            time.sleep(0.1)

    def _finalize(self, ev: Evaluation) -> None:
        ev.record = finalize(ev.name, ev.path, ev.running or self._base(ev), ev.stopped_after_s)

    def _signal(self, ev: Evaluation, sig: int) -> None:
        """Stop a runner (SIGTERM: it stops its evaluator and records that); SIGKILL: the runner and
        its evaluator's process group."""
        try:
            if ev.proc is not None:
                if ev.proc.poll() is None:
                    ev.proc.send_signal(sig)
            elif runner_state(ev.running or {}, ev.path / records.WORKDIR) == "alive":
                os.kill(ev.running["pid"], sig)  # provably our runner (runner_state checked its command line)
            evaluator = records_json(ev.path / records.WORKDIR / EVALUATOR_PID) if sig == signal.SIGKILL else None
            if evaluator and isinstance(evaluator.get("pid"), int) and evaluator["pid"] > 0:
                os.killpg(evaluator["pid"], sig)  # the evaluator's own process group
        except (ProcessLookupError, PermissionError, KeyError, TypeError):
            pass

    def _unstarted(self, ev: Evaluation, waited: float) -> dict:
        """The record of an evaluation the end of training left in line (written into its snapshot)."""
        record = {**self._base(ev), "status": records.UNFINISHED,
                  "error": f"not started: the training ended first (after waiting {waited:.0f} s, "
                           "evaluate.wait_at_end_s); `paddle-fullparam evaluate` runs it"}
        if ev.adopted:
            record = finalize(ev.name, ev.path, ev.running or record, waited)
        elif snapshot_identity(ev.path) is not None:
            try:
                records.write_record(ev.path, record)
            except OSError as e:
                record["error"] += f" (the record could not be written: {e})"
        return record


def records_json(path: Path) -> Optional[dict]:
    import json

    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def finalize(name: str, path: Path, running: dict, stopped_after_s: Optional[float] = None) -> dict:
    """The final record from the runner's status (None if it left none), written into the snapshot
    if it is still the one evaluated; the work folder is removed. Returns the record."""
    work = path / records.WORKDIR
    status = records_json(work / STATUS)
    record = results.final_record(running, status, work / OUTPUT, results.log_tail(path / records.LOG),
                                  stopped_after_s)
    if status is None:
        err = results.log_tail(work / "runner.err", 500)
        if err:
            record["error"] += f"; the runner said: {err}"
    identity = snapshot_identity(path)
    if identity is None or (running.get("identity") and identity != running.get("identity")):
        record["error"] = ((record.get("error") + "; ") if record.get("error") else "") + (
            "the snapshot was removed while it was evaluated" if identity is None else
            "the snapshot was replaced while it was evaluated: this result is not recorded")
        record["recorded"] = False
        return record
    records.write_record(path, record)
    if work.is_dir() and is_marked(work):
        delete_marked(work)
    return record


def runner_state(running: dict, work: Path) -> str:
    """``alive`` | ``dead`` for the runner of a running record: on this host, its pid must exist and
    run ``runner.py`` on this work folder; on another host it counts as alive until its timeout (plus
    a margin) has passed."""
    host, pid = running.get("host"), running.get("pid")
    if host and host != socket.gethostname():
        started, timeout = running.get("started_unix"), running.get("timeout_s")
        if isinstance(started, (int, float)) and isinstance(timeout, (int, float)):
            return "alive" if time.time() < started + timeout + BACKSTOP_S + 300 else "dead"
        return "dead"
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return "alive" if is_alive(pid, str(work)) else "dead"
    return "alive" if find(str(work)) is not None else "dead"  # a job that died before it recorded the pid
