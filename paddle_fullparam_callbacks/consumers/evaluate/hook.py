"""The evaluation hook: committed snapshots scored in separate processes while training goes on.

Only the coordinator has one (the Committer calls :meth:`EvaluationHook.committed` after each
commit). It is a consumer (``../hook.py``: the line, the workers, drain, wait-then-stop, adoption);
what is its own: a commit puts the snapshot in line every ``evaluate.every``-th time (and the last
one at the end); up to ``evaluate.max_concurrent`` worker threads each start a runner process
(``../runner.py``: its own session, lower CPU priority, the evaluator's output to the snapshot's
log), write the ``running`` record, wait for the runner, and write the final record; the training
thread collects finished evaluations with :meth:`drain` at its next event (to log the scores
through the trainer and refresh ``best`` and retention, which are the coordinator's file
operations, serialised with the commits). Snapshots in line, running or not yet drained are in
:meth:`busy`: retention keeps them.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ...config.schema import EvaluateConfig
from ...config.serving import format_adapter_path
from ...export.commit import evaluation as records
from ...export.commit.ownership import delete_marked, is_marked, mark, snapshot_identity
from ..holds import Holds
from ..hook import BACKSTOP_S, ConsumerHook, Job, LandingQueue, not_recordable
from ..records import log_tail
from ..runner import EVALUATOR_PID, STATUS, find, is_alive
from . import result as results
from .command import build_argv, describe

logger = logging.getLogger("paddle_fullparam_callbacks")

OUTPUT = "output.json"


@dataclass
class Evaluation(Job):
    """One snapshot's evaluation (``name``: hf-step-000010, or checkpoint-10/hf for the checkpoint hook's)."""

    in_output_dir: bool = True  # retention and best apply to it
    submitted_unix: float = field(default_factory=time.time)
    holding: bool = False  # it holds the engine on its snapshot until it lands (evaluate.lm_eval.engine_hold)

    @property
    def kept(self) -> bool:
        return self.in_output_dir

    @property
    def scores(self) -> dict:
        return records.scores_of(self.record)


class EvaluationHook(ConsumerHook):
    """Runs ``evaluate.command`` / ``evaluate.callable`` on committed snapshots (the coordinator's)."""

    THREAD, FAULT, WHO = "pfc-evaluate-{}", "evaluate_running", "the evaluation hook"
    WORKDIR, LOG = records.WORKDIR, records.LOG

    def __init__(self, cfg: EvaluateConfig, python: List[str], run_id: str = "evaluate",
                 api_key_env: Optional[str] = None, holds: Optional[Holds] = None, serve=None):
        super().__init__(cfg, run_id, workers=cfg.max_concurrent)
        self.python = list(python)
        self.api_key_env = api_key_env  # serve.api_key_env: evaluate.lm_eval's engine backend sends the key
        self.holds = holds  # evaluate.lm_eval.engine_hold: a snapshot in line holds the engine's next swap
        self.serve = serve  # the serve section: its adapter mode changes what the engine backend requests
        self._done = LandingQueue(self._landed)
        self._commits = 0
        self._last: Optional[Evaluation] = None
        self._last_due = False
        self._warned_backlog = False

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int, in_output_dir: bool = True) -> bool:
        """A snapshot was committed (on the training thread, or a background commit's): evaluate it if
        it is an ``evaluate.every``-th one. Returns whether it was put in line."""
        ev = Evaluation(name, Path(path).resolve(), int(step), in_output_dir=in_output_dir)
        with self._cond:
            self._commits += 1
            due = bool(self.cfg.every) and self._commits % self.cfg.every == 0
            self._last, self._last_due = ev, due
        if due:
            self._hold_and_submit(ev)
        return due

    def training_ended(self) -> None:
        """``evaluate.last``: the last committed snapshot is evaluated too, if it was not."""
        with self._cond:
            ev, due, self._last_due = self._last, self._last_due, True
        if ev is not None and not due and self.cfg.last and ev.path.is_dir():
            self._hold_and_submit(ev)

    def _hold_and_submit(self, ev: Evaluation) -> None:
        """Held before it is in line (the serving hook hears of the commit after this hook), released when it lands."""
        if self.holds is not None:
            self.holds.hold(ev.name)
            ev.holding = True
        if not self.submit(ev) and ev.holding:  # not taken (the end of training): it never lands
            ev.holding = False
            self.holds.release(ev.name)

    def _landed(self, ev: Evaluation) -> None:
        if ev.holding:
            ev.holding = False
            self.holds.release(ev.name)

    def submit(self, ev: Evaluation) -> int:
        backlog = super().submit(ev)
        if backlog > 2 * self.cfg.max_concurrent and not self._warned_backlog:
            self._warned_backlog = True
            logger.warning("evaluations fall behind the snapshots: %d wait in line (evaluate.max_concurrent=%d); "
                           "their snapshots are kept until they are evaluated", backlog, self.cfg.max_concurrent)
        return backlog

    # ---- one evaluation ----------------------------------------------------------------------
    def _write(self, ev: Evaluation, record: dict) -> None:
        records.write_record(ev.path, record)

    def alive(self, running: dict, work: Path) -> bool:
        return runner_works(running, work)

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

    def _start(self, ev: Evaluation) -> None:
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
        argv = build_argv(self.cfg, self.python, ev.path, ev.step, output, ev.name, self.api_key_env,
                          adapter=self._adapter(ev))
        env = {"PFC_SNAPSHOT": str(ev.path), "PFC_STEP": str(ev.step), "PFC_OUTPUT": str(output)}
        self._launch(ev, work, argv, env, identity, head={"command": describe(argv)})

    def _adapter(self, ev: Evaluation) -> Optional[dict]:
        """``serve.adapter``: the engine backend requests the stable adapter name, which serves the snapshot while
        that name's directory is the snapshot's adapter (as the engine sees it)."""
        s = self.serve
        if s is None or not s.adapter or self.cfg.lm_eval.backend != "engine":
            return None
        return {"name": s.adapter_name, "root": format_adapter_path(s.path_template, str(ev.path), ev.name, ev.step)}

    def _finalize(self, ev: Evaluation) -> None:
        ev.record = finalize(ev.name, ev.path, ev.running or self._base(ev), ev.stopped_after_s)

    def _signal(self, ev: Evaluation, sig: int) -> None:
        """Stop a runner (SIGTERM: it stops its evaluator and records that); SIGKILL: the runner and
        its evaluator's process group."""
        super()._signal(ev, sig)
        if sig != signal.SIGKILL:
            return
        evaluator = records_json(ev.path / records.WORKDIR / EVALUATOR_PID)
        try:
            if evaluator and isinstance(evaluator.get("pid"), int) and evaluator["pid"] > 0:
                os.killpg(evaluator["pid"], sig)  # the evaluator's own process group
        except (ProcessLookupError, PermissionError):
            pass

    def _unstarted(self, ev: Evaluation, waited: float) -> dict:
        record = {**self._base(ev), "status": records.UNFINISHED,
                  "error": f"not started: the training ended first (after waiting {waited:.0f} s, "
                           "evaluate.wait_at_end_s); `paddle-fullparam evaluate` runs it"}
        if ev.adopted:
            return finalize(ev.name, ev.path, ev.running or record, waited)
        return self._keep(ev, record)


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
    record = results.final_record(running, status, work / OUTPUT, log_tail(path / records.LOG),
                                  stopped_after_s)
    if status is None:
        err = log_tail(work / "runner.err", 500)
        if err:
            record["error"] += f"; the runner said: {err}"
    if not_recordable(record, path, running, "evaluated"):
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


def runner_works(running: dict, work: Path) -> bool:
    """Whether the runner of a running record still works (:func:`runner_state`): the hook's test."""
    return runner_state(running, work) == "alive"
