"""The hook base of every consumer of committed snapshots: the evaluation hook (``evaluate/hook.py``),
the publisher (``publish/hook.py``), and any third one (a serving engine's weight reload, a vendor CLI).

A consumer acts on snapshots already committed, each job in a runner process (``runner.py``: a session
of its own, lower priority, the program's log, a timeout, a status file) while training goes on. Only
the coordinator has one; nothing of it runs on the training thread but bookkeeping. What every consumer
does alike is here:

- **the line**: :meth:`ConsumerHook.submit` puts a :class:`Job` in line; up to ``workers`` threads take
  the next one (:meth:`~ConsumerHook._take`), run it and put it in the done queue, which the training
  thread empties with :meth:`~ConsumerHook.drain`; :meth:`~ConsumerHook.busy` names the snapshots that
  retention keeps meanwhile (in line, running, or not yet drained);
- **one job in a runner** (:meth:`~ConsumerHook._launch`): the spec, the runner started in a session of
  its own, the ``running`` record (the record's preamble, host, pid, start, timeout, log, the snapshot's
  identity), a backstop beyond the timeout, the final record;
- **adoption**: a runner an earlier job left working is watched until it ends (:meth:`~ConsumerHook.adopt`);
  :func:`settle_left` is the recovery's entry point (adopt what still runs, record what has ended);
- **the end** (:meth:`~ConsumerHook.close`): wait up to ``wait_s``, then record what never started and
  stop what runs (SIGTERM: the runner stops its program and says so; SIGKILL for one that does not).

A consumer writes only what is its own: its record (:meth:`~ConsumerHook._base`, :meth:`~ConsumerHook._write`),
how one job starts (:meth:`~ConsumerHook._start`: work folder, argv, then ``_launch``), its final record
from the runner's status (:meth:`~ConsumerHook._finalize`), and the record of a job the end of training
left in line (:meth:`~ConsumerHook._unstarted`).
"""
from __future__ import annotations

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
from typing import Callable, Dict, List, Optional, Set

from .. import _faults
from ..export.commit.ownership import snapshot_identity
from ..export.write.fsync import write_json_durable
from .runner import KILL_GRACE_S, STATUS, is_alive

RUNNER = Path(__file__).resolve().with_name("runner.py")
RUNNING, FAILED = "running", "failed"  # the same words in every consumer's record
BACKSTOP_S = 60.0  # beyond the job's timeout_s: the hook stops a runner that did not stop itself
STOP_WAIT_S = 15.0  # at the end: how long stopped jobs get to record themselves as unfinished


class LandingQueue(queue.Queue):
    """A done queue that tells ``landed(job)`` of every job put in it (after it is in)."""

    def __init__(self, landed: Callable[["Job"], None]):
        super().__init__()
        self._landed = landed

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self._landed(item)


@dataclass
class Job:
    """One snapshot's job (an evaluation, a publication), from the line to its final record."""

    name: str
    path: Path
    step: int
    running: Optional[dict] = None  # the running record (an earlier job's, for an adopted runner)
    record: Optional[dict] = None  # the final record
    adopted: bool = False  # an earlier job's runner, still working at this start: watched, not started
    recovered: bool = False  # left by an earlier job, settled at this start
    proc: Optional[subprocess.Popen] = None
    stopped_after_s: Optional[float] = None  # stopped by the end of training, after waiting this long
    order: float = field(default_factory=time.monotonic)  # when it was put in line (ties of one step)

    @property
    def status(self) -> str:
        return (self.record or {}).get("status", RUNNING)

    @property
    def of_snapshot(self) -> bool:
        """A job on one snapshot, with a record (False: a job of the hook's own, e.g. on a store)."""
        return True

    @property
    def kept(self) -> bool:
        """Retention keeps its snapshot until the job is drained."""
        return self.of_snapshot


def runner_alive(running: dict, work: Path) -> bool:
    """Whether the runner of a running record works on ``work`` (on this host: ``/proc``)."""
    return is_alive(running.get("pid"), str(work))


class ConsumerHook:
    """The coordinator's line of jobs on committed snapshots; a consumer subclasses it (see the module)."""

    THREAD = "pfc-consumer-{}"  # the worker threads' names ({} is the thread's number)
    FAULT = "consumer_running"  # the crash tests' fault point, right after the running record
    WHO = "the consumer"  # named in the record of a job the hook itself failed
    WORKDIR = ".fullparam-consumer"  # the marked work folder in the snapshot (spec, the runner's status)
    LOG = "fullparam_consumer.log"  # the program's output, beside the snapshot's record
    POLL_S = 1.0  # how often an adopted runner (an earlier job's, not our child) is looked at
    STOP_RUNNING = True  # at the end, stop what still runs after the wait (False: let it end by its own bounds)
    DONE = STATUS  # the file in the work folder that says a job's process has ended

    def __init__(self, cfg, run_id: str, workers: int = 1, skip_behind: bool = False):
        """``cfg`` has the consumer's ``timeout_s`` and ``nice``; ``workers`` jobs run at a time; ``skip_behind``:
        when several snapshots wait, the newest wins (:meth:`_newest_wins`)."""
        self.cfg, self.run_id, self.workers, self.skip_behind = cfg, run_id, workers, skip_behind
        self._cond = threading.Condition()
        self._line: List[Job] = []
        self._running: Dict[str, Job] = {}
        self._done: "queue.Queue[Job]" = queue.Queue()
        self._undrained: Set[str] = set()
        self._threads: List[threading.Thread] = []
        self._closing = threading.Event()
        self._waited_s: Optional[float] = None  # close(): how long the end of training waited

    # ---- what a consumer writes --------------------------------------------------------------
    def _base(self, job: Job) -> dict:
        """The preamble of every record of ``job``."""
        return {"snapshot": job.name, "step": job.step, "run": self.run_id}

    def _write(self, job: Job, record: dict) -> None:
        """Write ``record`` as the snapshot's record (atomically)."""
        raise NotImplementedError

    def _start(self, job: Job) -> None:
        """Run one job: prepare its work folder and argv, then :meth:`_launch`."""
        raise NotImplementedError

    def _finalize(self, job: Job) -> None:
        """``job.record`` from the runner's status, written if the snapshot is still the one worked on."""
        raise NotImplementedError

    def _unstarted(self, job: Job, waited: float) -> dict:
        """The record of a job the end of training left in line (written into its snapshot)."""
        raise NotImplementedError

    def _record_failure(self, job: Job) -> None:
        """The hook itself failed on ``job`` (``job.record`` says how): write it, best effort."""
        if job.of_snapshot and snapshot_identity(job.path) is not None:
            try:
                self._write(job, job.record)
            except OSError:
                pass

    def alive(self, running: dict, work: Path) -> bool:
        """Whether the runner of a running record still works on ``work``."""
        return runner_alive(running, work)

    # ---- the training side -------------------------------------------------------------------
    def submit(self, job: Job) -> int:
        """Put ``job`` in line (no I/O); returns how many jobs wait in line (0 once closing)."""
        with self._cond:
            if self._closing.is_set():
                return 0
            if not self._enqueue(job):
                return len(self._line)
            if job.kept:
                self._undrained.add(job.name)
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=self.THREAD.format(len(self._threads)), daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify_all()
            return len(self._line)

    def _enqueue(self, job: Job) -> bool:
        """(The lock held) put ``job`` in line; False drops it."""
        self._line.append(job)
        return True

    def adopt(self, job: Job) -> None:
        """Watch a job an earlier process left running (its runner is alive): recorded when it ends."""
        job.adopted = True
        self.submit(job)

    def busy(self) -> Set[str]:
        """Names of the kept snapshots in line, being worked on, or whose result is not drained."""
        with self._cond:
            return set(self._undrained)

    def pending(self) -> int:
        with self._cond:
            return sum(job.of_snapshot for job in self._line) + len(self._running)

    def drain(self) -> List[Job]:
        """Finished jobs since the last drain (non-blocking; the training thread's)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._cond:
            self._undrained -= {job.name for job in out if job.kept}
        return out

    def close(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the jobs in line or running; record the rest as never started, stop
        the running ones (they record themselves as unfinished). Their results are then in :meth:`drain`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (self._line or self._running) and deadline - time.monotonic() > 0:
                self._cond.wait(deadline - time.monotonic())
            self._waited_s = wait_s
            self._closing.set()
            left, self._line = self._line, []
            running = list(self._running.values())
            self._cond.notify_all()
        for job in left:
            if job.of_snapshot:
                job.record = self._unstarted(job, wait_s)
                self._done.put(job)
        if not self.STOP_RUNNING:  # bounded by their own timeouts (the runner's, and the backstop beyond it)
            with self._cond:
                while self._running:
                    self._cond.wait()
            return
        for job in running:
            if job.of_snapshot:
                job.stopped_after_s = wait_s
                self._signal(job, signal.SIGTERM)
        end = time.monotonic() + STOP_WAIT_S
        with self._cond:
            while self._running and end - time.monotonic() > 0:
                self._cond.wait(end - time.monotonic())
            stuck = list(self._running.values())
        for job in stuck:  # a runner that did not stop itself: its record says unfinished anyway
            self._signal(job, signal.SIGKILL)

    # ---- the workers -------------------------------------------------------------------------
    def _blocked(self) -> bool:
        """(The lock held, the line not empty) whether the next job must wait for now (a consumer's own reason;
        whoever lifts it notifies the lock's condition). Never at the end of training."""
        return False

    def _take(self) -> Optional[Job]:
        """(The lock held, the line not empty) the next job: the oldest."""
        return self._line.pop(0)

    def _newest_wins(self, keep: Callable[[Job, Job], bool] = lambda job, newest: False):
        """(The lock held, the line not empty) ``(next, superseded)``: with ``skip_behind`` the newest snapshot
        waiting, and the others it supersedes (out of the line, for the caller to record as skipped) but those
        ``keep(job, newest)`` keeps in line; without it the oldest, every snapshot in turn."""
        if not self.skip_behind:
            first = min(self._line, key=lambda j: (j.step, j.order))
            self._line.remove(first)
            return first, []
        newest = max(self._line, key=lambda j: (j.step, j.order))
        kept = [j for j in self._line if j is not newest and keep(j, newest)]
        superseded = [j for j in self._line if j is not newest and j not in kept]
        self._line = kept
        return newest, superseded

    def _work(self) -> None:
        while True:
            with self._cond:
                while (not self._line or self._blocked()) and not self._closing.is_set():
                    self._cond.wait()
                job = self._take() if self._line else None
                if job is None:
                    if self._closing.is_set():
                        return
                    continue
                self._running[str(job.path)] = job
            try:
                self._run(job)
            except Exception as e:  # never into training: recorded, logged once at the drain
                job.record = {**(job.running or self._base(job)), "status": FAILED,
                              "error": f"{self.WHO} failed: {type(e).__name__}: {e}"}
                self._record_failure(job)
            finally:
                with self._cond:
                    self._running.pop(str(job.path), None)
                    self._cond.notify_all()
                self._done.put(job)

    def _run(self, job: Job) -> None:
        self._watch(job) if job.adopted else self._start(job)

    def _launch(self, job: Job, work: Path, argv: List[str], env: Dict[str, str], identity: dict,
                head: Optional[dict] = None, tail: Optional[dict] = None) -> None:
        """Run ``argv`` for ``job`` in a runner on ``work`` (the spec, the running record with ``head`` and
        ``tail`` around the common keys, the timeout's backstop), then :meth:`_finalize`."""
        write_json_durable(work / "spec.json", {
            "package": "paddle_fullparam_callbacks", "argv": argv, "env": env, "timeout_s": self.cfg.timeout_s,
            "nice": self.cfg.nice, "log": str(job.path / self.LOG), "cwd": os.getcwd()})
        with open(work / "runner.err", "wb") as err:
            job.proc = subprocess.Popen([sys.executable, "-I", str(RUNNER), str(work)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        job.running = {**self._base(job), "status": RUNNING, **(head or {}), "host": socket.gethostname(),
                       "pid": job.proc.pid, "started_unix": time.time(), "timeout_s": self.cfg.timeout_s,
                       "log": self.LOG, "identity": identity, **(tail or {})}
        self._write(job, job.running)
        _faults.point(self.FAULT)
        if self._closing.is_set():  # started as the training ended: stop it (a second SIGTERM is harmless)
            job.stopped_after_s = self._waited_s
            self._signal(job, signal.SIGTERM)
        try:
            job.proc.wait(timeout=self.cfg.timeout_s + BACKSTOP_S)
        except subprocess.TimeoutExpired:
            self._signal(job, signal.SIGKILL)
            job.proc.wait()
        self._finalize(job)

    def _watch(self, job: Job) -> None:
        """An earlier job's runner (not our child): looked at until it has ended, then recorded."""
        running, work = job.running or {}, job.path / self.WORKDIR
        started = running.get("started_unix") if isinstance(running.get("started_unix"), (int, float)) else time.time()
        deadline = started + float(running.get("timeout_s") or self.cfg.timeout_s) + BACKSTOP_S
        while self.alive(running, work) and not (work / self.DONE).exists():
            if time.time() > deadline:
                self._signal(job, signal.SIGKILL)
                break
            if self._closing.is_set() and not self.STOP_RUNNING:
                time.sleep(self.POLL_S)  # watched until it ends, within its deadline
                continue
            if self._closing.wait(self.POLL_S):
                job.stopped_after_s = self._waited_s
                self._signal(job, signal.SIGTERM)
                end = time.monotonic() + KILL_GRACE_S + 2
                while self.alive(running, work) and not (work / self.DONE).exists() and time.monotonic() < end:
                    time.sleep(0.1)
                break
        self._finalize(job)

    def _signal(self, job: Job, sig: int) -> None:
        """Signal the job's runner (SIGTERM: it stops its program and records that)."""
        try:
            if job.proc is not None:
                if job.proc.poll() is None:
                    job.proc.send_signal(sig)
            elif self.alive(job.running or {}, job.path / self.WORKDIR):
                os.kill(job.running["pid"], sig)
        except (ProcessLookupError, PermissionError, KeyError, TypeError):
            pass

    def _keep(self, job: Job, record: dict) -> dict:
        """Write ``record`` into the job's snapshot if the snapshot is still there (a failed write is said
        in its error); returns it."""
        if snapshot_identity(job.path) is not None:
            try:
                self._write(job, record)
            except OSError as e:
                record["error"] += f" (the record could not be written: {e})"
        return record


def not_recordable(record: dict, path: Path, running: dict, verb: str) -> bool:
    """True (and ``record`` says why, with ``recorded: False``) when the snapshot at ``path`` was removed,
    or replaced by another one, while it was ``verb`` (evaluated, published): its result is not written."""
    identity = snapshot_identity(path)
    if identity is not None and not (running.get("identity") and identity != running.get("identity")):
        return False
    record["error"] = ((record.get("error") + "; ") if record.get("error") else "") + (
        f"the snapshot was removed while it was {verb}" if identity is None else
        f"the snapshot was replaced while it was {verb}: this result is not recorded")
    record["recorded"] = False
    return True


def settle_left(job: Job, work: Path, alive: Callable[[dict, Path], bool], finalize: Callable[[], dict],
                done: str = STATUS) -> bool:
    """The recovery's entry point for a job an earlier process left ``running`` (``job.running``): True
    when its runner still works on ``work`` (no ``done`` file yet): ``job.adopted``, for a hook to watch; else
    False, with its final record (``job.record``) from ``finalize``, which records what the runner left."""
    if alive(job.running or {}, work) and not (work / done).exists():
        job.adopted = True
        return True
    job.record = finalize()
    return False
