"""The coordinator's line of publications: committed snapshots go out one at a time, each in a runner
process (``consumers/runner.py``, the evaluation hook's: lower priority, its own session, log, timeout,
status) that runs the S3 publishing process (``worker.py``) or ``publish.command``.

Nothing of it runs on the training thread but bookkeeping: :meth:`PublishHook.committed` puts a
snapshot in line; one worker thread takes the next, writes the ``running`` record, starts the runner,
waits for it, and writes the final record; the training thread collects finished publications with
:meth:`drain` (to log each failure or skip once). When publishing falls behind (several snapshots
wait), the newest and the one ``best`` names win; every other waiting snapshot is recorded as
``skipped``. Snapshots in line, being published or not yet drained are in :meth:`busy`: local retention
keeps them. Small jobs on the store itself (moving ``best`` to a snapshot already published, aborting
uploads a killed job left) run on the worker thread, in this process.
"""
from __future__ import annotations

import dataclasses
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
from typing import Callable, Dict, List, Optional, Set

from ... import _faults
from ...config.schema import FullParamConfig
from ...export.commit.ownership import delete_marked, is_marked, mark, snapshot_identity
from ...export.commit.pointers import read_pointer
from ..runner import KILL_GRACE_S, STATUS, is_alive
from ...export.write.fsync import write_json_durable
from . import records
from .result import final_entry

logger = logging.getLogger("paddle_fullparam_callbacks")

RUNNER = Path(__file__).resolve().parents[1] / "runner.py"
SPEC, OUTPUT = "publish.json", "output.json"
BACKSTOP_S = 60.0
STOP_WAIT_S = 15.0
POLL_S = 0.5
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding paddle_fullparam_callbacks/


@dataclass
class Publication:
    """One snapshot's publication, from the line to its final record (or a job on the store: ``kind``)."""

    name: str
    path: Path
    step: int
    kind: str = "snapshot"  # snapshot | pointers | cleanup
    running: Optional[dict] = None
    entry: Optional[dict] = None  # the final record entry
    adopted: bool = False  # an earlier job's runner, still running at this start
    recovered: bool = False
    proc: Optional[subprocess.Popen] = None
    stopped_after_s: Optional[float] = None
    keep: List[str] = field(default_factory=list)  # cleanup: the snapshots whose uploads are resumed, not aborted
    order: float = field(default_factory=time.monotonic)

    @property
    def status(self) -> str:
        return (self.entry or {}).get("status", records.RUNNING)


class PublishHook:
    """Publishes the committed snapshots of ``output_dir`` as ``config.publish`` says (the coordinator's)."""

    def __init__(self, config: FullParamConfig, output_dir: Path, run_id: str, store_factory: Optional[Callable] = None,
                 skip_behind: bool = True):
        self.config, self.cfg = config, config.publish
        self.output_dir, self.run_id = Path(output_dir).resolve(), run_id
        self.destination = self.cfg.url or "command"
        self._store_factory = store_factory
        self._store = None
        self._cond = threading.Condition()
        self._line: List[Publication] = []
        self._running: Optional[Publication] = None
        self._done: "queue.Queue[Publication]" = queue.Queue()
        self._undrained: Set[str] = set()
        self._skipped: List[Publication] = []
        self._thread: Optional[threading.Thread] = None
        self._closing = threading.Event()
        self._waited_s: Optional[float] = None
        self.skip_behind = skip_behind  # False (paddle-fullparam publish): every snapshot in line, oldest first

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int) -> None:
        """A snapshot was committed into output_dir: it goes in line (the training thread's: no I/O)."""
        self.submit(Publication(name, Path(path).resolve(), int(step)))

    def submit(self, pub: Publication) -> None:
        with self._cond:
            if self._closing.is_set():
                return
            if pub.kind != "snapshot" and any(p.kind == pub.kind for p in self._line):
                return  # one of these waits already
            self._line = [p for p in self._line if not (p.kind == "snapshot" and p.name == pub.name)]  # re-exported
            self._line.append(pub)
            if pub.kind == "snapshot":
                self._undrained.add(pub.name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="pfc-publish", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def refresh_pointers(self) -> None:
        """``best`` moved (new evaluation scores): the store's best follows once it holds that snapshot."""
        if self.cfg.url:
            self.submit(Publication("best", self.output_dir, 0, kind="pointers"))

    def busy(self) -> Set[str]:
        with self._cond:
            return set(self._undrained)

    def pending(self) -> int:
        with self._cond:
            return sum(p.kind == "snapshot" for p in self._line) + (self._running is not None)

    def drain(self) -> List[Publication]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._cond:
            self._undrained -= {p.name for p in out if p.kind == "snapshot"}
        return out

    def close(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the line and the running publication; stop the rest and record it as
        unfinished (the next start finishes it). Results are then in :meth:`drain`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (self._line or self._running) and deadline > time.monotonic():
                self._cond.wait(deadline - time.monotonic())
            self._waited_s = wait_s
            self._closing.set()
            left, self._line = self._line, []
            running = self._running
            self._cond.notify_all()
        for pub in left:
            if pub.kind == "snapshot":
                pub.entry = self._unfinished(pub, f"not started: the training ended first (after waiting {wait_s:.0f} s, "
                                                  "publish.wait_at_end_s)")
                self._done.put(pub)
        if running is not None and running.kind == "snapshot":
            running.stopped_after_s = wait_s
            self._signal(running, signal.SIGTERM)
        end = time.monotonic() + STOP_WAIT_S
        with self._cond:
            while self._running is not None and end > time.monotonic():
                self._cond.wait(end - time.monotonic())
            stuck = self._running
        if stuck is not None:
            self._signal(stuck, signal.SIGKILL)

    # ---- the worker thread -------------------------------------------------------------------
    def _next(self) -> Optional[Publication]:
        """The next job (the lock held): jobs on the store and adopted publications first; of the snapshots
        waiting, the newest and the one ``best`` names win, the others are recorded as skipped."""
        for p in self._line:
            if p.kind != "snapshot" or p.adopted:
                self._line.remove(p)
                return p
        if not self._line:
            return None
        if not self.skip_behind:
            first = min(self._line, key=lambda p: (p.step, p.order))
            self._line.remove(first)
            return first
        newest = max(self._line, key=lambda p: (p.step, p.order))
        best = read_pointer(self.output_dir, "best")
        winners = [newest] + [p for p in self._line if p.name == best and p is not newest]
        for p in self._line:
            if p not in winners:  # recorded by the worker thread, outside the lock (the training thread's)
                p.entry = {**self._base(p), "status": records.SKIPPED,
                           "error": f"publishing fell behind and newer snapshots won ({newest.name} is "
                                    "published instead)"}
                self._skipped.append(p)
        self._line = winners[1:]
        return winners[0]

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._line and not self._closing.is_set():
                    self._cond.wait()
                pub = self._next() if self._line else None
                if pub is None:
                    if self._closing.is_set():
                        return
                    continue
                self._running = pub
                skipped, self._skipped = self._skipped, []
            for p in skipped:
                try:
                    if snapshot_identity(p.path) is not None:
                        self._write(p, p.entry)
                except OSError as e:
                    p.entry["error"] += f" (the record could not be written: {e})"
                self._done.put(p)
            try:
                if pub.kind == "snapshot":
                    self._watch(pub) if pub.adopted else self._publish(pub)
                else:
                    self._store_job(pub)
            except Exception as e:  # never into training: recorded, logged once at the drain
                pub.entry = {**(pub.running or self._base(pub)), "status": records.FAILED,
                             "error": f"the publisher failed: {type(e).__name__}: {e}"}
                if pub.kind == "snapshot" and snapshot_identity(pub.path) is not None:
                    try:
                        self._write(pub, pub.entry)
                    except OSError:
                        pass
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()
                self._done.put(pub)

    def _base(self, pub: Publication) -> dict:
        return {"snapshot": pub.name, "step": pub.step, "destination": self.destination, "run": self.run_id}

    def _write(self, pub: Publication, entry: dict) -> None:
        records.write(pub.path, self.destination, entry)

    def store(self):
        if self._store is None:
            from .store import Store

            self._store = (self._store_factory or Store)(self.cfg)
        return self._store

    def spec(self, pub: Publication, work: Path) -> dict:
        ret = self.config.retention
        return {"snapshot": str(pub.path), "name": pub.name, "step": pub.step, "output_dir": str(self.output_dir),
                "work": str(work), "publish": dataclasses.asdict(self.cfg), "name_template": self.config.export.name_template,
                "run_id": (snapshot_identity(pub.path) or {}).get("run") or self.run_id, "other_runs": ret.other_runs, "metric": ret.metric, "mode": ret.mode}

    def _store_job(self, pub: Publication) -> None:
        from .engine import sync_pointers

        if pub.kind == "pointers":
            pub.entry = {"status": records.OK, **sync_pointers(self.store(), self.spec(pub, self.output_dir))}
        else:  # cleanup: uploads under the prefix for snapshots no publication here will resume
            keep = set(pub.keep)
            store, aborted = self.store(), 0
            for key, upload_id in store.uploads(store.key("") + "/" if store.prefix else ""):
                name = key[len(store.prefix) + 1:].split("/", 1)[0] if store.prefix else key.split("/", 1)[0]
                if name not in keep:
                    store.abort(key, upload_id)
                    aborted += 1
            pub.entry = {"status": records.OK, "aborted_uploads": aborted}

    def _publish(self, pub: Publication) -> None:
        if self._closing.is_set():
            pub.entry = self._unfinished(pub, "not started: the training ended first")
            return
        ident = snapshot_identity(pub.path)
        if ident is None:
            pub.entry = {**self._base(pub), "status": records.FAILED, "error": "the snapshot is gone (removed before "
                                                                               "its publication started)"}
            return
        work = prepare_work(pub.path, self.run_id)
        argv = self._argv(pub, work)
        env = {"PFC_SNAPSHOT": str(pub.path), "PFC_STEP": str(pub.step), "PFC_OUTPUT": str(work / OUTPUT),
               "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
        write_json_durable(work / "spec.json", {
            "package": "paddle_fullparam_callbacks", "argv": argv, "env": env, "timeout_s": self.cfg.timeout_s,
            "nice": self.cfg.nice, "log": str(pub.path / records.LOG), "cwd": os.getcwd()})
        with open(work / "runner.err", "wb") as err:
            pub.proc = subprocess.Popen([sys.executable, "-I", str(RUNNER), str(work)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        pub.running = {**self._base(pub), "status": records.RUNNING, "host": socket.gethostname(), "pid": pub.proc.pid,
                       "started_unix": time.time(), "timeout_s": self.cfg.timeout_s, "log": records.LOG,
                       "identity": ident, **({"command": self.cfg.command} if self.cfg.command else {})}
        self._write(pub, pub.running)
        _faults.point("publish_running")
        if self._closing.is_set():
            pub.stopped_after_s = self._waited_s
            self._signal(pub, signal.SIGTERM)
        try:
            pub.proc.wait(timeout=self.cfg.timeout_s + BACKSTOP_S)
        except subprocess.TimeoutExpired:
            self._signal(pub, signal.SIGKILL)
            pub.proc.wait()
        pub.entry = finalize(pub.path, self.destination, pub.running, pub.stopped_after_s)

    def _argv(self, pub: Publication, work: Path) -> List[str]:
        if self.cfg.url:
            write_json_durable(work / SPEC, self.spec(pub, work))
            return [sys.executable, "-m", "paddle_fullparam_callbacks.consumers.publish.worker", str(work / SPEC),
                    str(work / OUTPUT)]
        import shlex

        values = {"snapshot": str(pub.path), "name": pub.name, "step": str(pub.step), "output": str(work / OUTPUT)}
        out: List[str] = []
        for word in shlex.split(self.cfg.command):
            out.extend([sys.executable] if word == "{python}" else [word.format(python=sys.executable, **values)])
        return out

    def _watch(self, pub: Publication) -> None:
        """An earlier job's runner (not our child): looked at until it ends."""
        running, work = pub.running or {}, pub.path / records.WORKDIR
        started = running.get("started_unix") if isinstance(running.get("started_unix"), (int, float)) else time.time()
        deadline = started + float(running.get("timeout_s") or self.cfg.timeout_s) + BACKSTOP_S
        while is_alive(running.get("pid"), str(work)) and not (work / STATUS).exists():
            if time.time() > deadline:
                self._signal(pub, signal.SIGKILL)
                break
            if self._closing.wait(POLL_S):
                pub.stopped_after_s = self._waited_s
                self._signal(pub, signal.SIGTERM)
                end = time.monotonic() + KILL_GRACE_S + 2
                while is_alive(running.get("pid"), str(work)) and not (work / STATUS).exists() and time.monotonic() < end:
                    time.sleep(0.1)
                break
        pub.entry = finalize(pub.path, self.destination, running, pub.stopped_after_s)

    def _signal(self, pub: Publication, sig: int) -> None:
        try:
            if pub.proc is not None:
                if pub.proc.poll() is None:
                    pub.proc.send_signal(sig)
            elif is_alive((pub.running or {}).get("pid"), str(pub.path / records.WORKDIR)):
                os.kill(pub.running["pid"], sig)
        except (ProcessLookupError, PermissionError, KeyError):
            pass

    def _unfinished(self, pub: Publication, why: str) -> dict:
        entry = {**self._base(pub), "status": records.UNFINISHED,
                 "error": f"{why}; the next start, or `paddle-fullparam publish`, finishes it"}
        if snapshot_identity(pub.path) is not None:
            try:
                self._write(pub, entry)
            except OSError as e:
                entry["error"] += f" (the record could not be written: {e})"
        return entry


def prepare_work(snapshot: Path, run_id: str) -> Path:
    """The snapshot's marked work folder, with an earlier attempt's journal kept (the rest is reset)."""
    work = snapshot / records.WORKDIR
    if work.exists() or work.is_symlink():
        if not (work.is_dir() and not work.is_symlink() and is_marked(work)):
            raise FileExistsError(f"{work} exists and is not this package's; left alone")
        for name in (STATUS, OUTPUT, SPEC, "spec.json", "runner.err"):
            (work / name).unlink(missing_ok=True)
        return work
    work.mkdir()
    mark(work, run_id)
    return work


def finalize(path: Path, destination: str, running: dict, stopped_after_s: Optional[float] = None) -> dict:
    """The final entry from the runner's status, written beside the snapshot if it is still the one
    published; the work folder goes once the publication is ok (else its journal stays for the resume)."""
    work = path / records.WORKDIR
    entry = final_entry(running, work / STATUS, work / OUTPUT, path / records.LOG, stopped_after_s)
    current = snapshot_identity(path)
    if current is None or (running.get("identity") and current != running.get("identity")):
        entry["error"] = ((entry.get("error") + "; ") if entry.get("error") else "") + (
            "the snapshot was removed while it was published" if current is None else
            "the snapshot was replaced while it was published: this result is not recorded")
        entry["recorded"] = False
        return entry
    records.write(path, destination, entry)
    if entry["status"] == records.OK and work.is_dir() and is_marked(work):
        delete_marked(work)
    return entry

