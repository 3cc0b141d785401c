"""The coordinator's line of publications: committed snapshots go out one at a time, each in a runner
process (``../runner.py``, the evaluation hook's: lower priority, its own session, log, timeout, status)
that runs the S3 publishing process (``worker.py``) or ``publish.command``.

It is a consumer (``../hook.py``: the line, the worker thread, drain, wait-then-stop, adoption); what is
its own: :meth:`PublishHook.committed` puts a snapshot in line; one worker thread takes the next, writes
the ``running`` record, starts the runner, waits for it, and writes the final record; the training thread
collects finished publications with :meth:`drain` (to log each failure or skip once). When publishing
falls behind (several snapshots wait), the newest and the one ``best`` names win; every other waiting
snapshot is recorded as ``skipped``. Snapshots in line, being published or not yet drained are in
:meth:`busy`: local retention keeps them. Small jobs on the store itself (moving ``best`` to a snapshot
already published, aborting uploads a killed job left) run on the worker thread, in this process.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from ...config.schema import FullParamConfig
from ...export.commit.ownership import delete_marked, is_marked, mark, snapshot_identity
from ...export.commit.pointers import read_pointer
from ...export.write.fsync import write_json_durable
from ..hook import ConsumerHook, Job, not_recordable
from ..runner import STATUS
from . import records
from .result import final_entry

SPEC, OUTPUT = "publish.json", "output.json"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding paddle_fullparam_callbacks/


@dataclass
class Publication(Job):
    """One snapshot's publication, from the line to its final record (or a job on the store: ``kind``)."""

    kind: str = "snapshot"  # snapshot | pointers | cleanup
    keep: List[str] = field(default_factory=list)  # cleanup: the snapshots whose uploads are resumed, not aborted

    @property
    def entry(self) -> Optional[dict]:
        """The final record entry (this destination's, in the snapshot's publication record)."""
        return self.record

    @entry.setter
    def entry(self, value: Optional[dict]) -> None:
        self.record = value

    @property
    def of_snapshot(self) -> bool:
        return self.kind == "snapshot"


class PublishHook(ConsumerHook):
    """Publishes the committed snapshots of ``output_dir`` as ``config.publish`` says (the coordinator's)."""

    THREAD, FAULT, WHO = "pfc-publish", "publish_running", "the publisher"
    WORKDIR, LOG = records.WORKDIR, records.LOG
    POLL_S = 0.5

    def __init__(self, config: FullParamConfig, output_dir: Path, run_id: str, store_factory: Optional[Callable] = None,
                 skip_behind: bool = True):
        super().__init__(config.publish, run_id, workers=1, skip_behind=skip_behind)
        self.config = config
        self.output_dir = Path(output_dir).resolve()
        self.destination = self.cfg.url or "command"
        self._store_factory = store_factory
        self._store = None
        self._skipped: List[Publication] = []  # skip_behind False (paddle-fullparam publish): every snapshot, oldest first

    # ---- the training side -------------------------------------------------------------------
    def committed(self, name: str, path: Path, step: int) -> None:
        """A snapshot was committed into output_dir: it goes in line (the training thread's: no I/O)."""
        self.submit(Publication(name, Path(path).resolve(), int(step)))

    def _enqueue(self, pub: Publication) -> bool:
        if pub.kind != "snapshot" and any(p.kind == pub.kind for p in self._line):
            return False  # one of these waits already
        self._line = [p for p in self._line if not (p.kind == "snapshot" and p.name == pub.name)]  # re-exported
        self._line.append(pub)
        return True

    def refresh_pointers(self) -> None:
        """``best`` moved (new evaluation scores): the store's best follows once it holds that snapshot."""
        if self.cfg.url:
            self.submit(Publication("best", self.output_dir, 0, kind="pointers"))

    # ---- the worker thread -------------------------------------------------------------------
    def _take(self) -> Optional[Publication]:
        """The next job (the lock held): jobs on the store and adopted publications first; of the snapshots
        waiting, the newest and the one ``best`` names win, the others are recorded as skipped."""
        for p in self._line:
            if p.kind != "snapshot" or p.adopted:
                self._line.remove(p)
                return p
        if not self._line:
            return None
        best = read_pointer(self.output_dir, "best") if self.skip_behind else None
        first, superseded = self._newest_wins(lambda p, newest: p.name == best)
        for p in superseded:  # recorded by the worker thread, outside the lock (the training thread's)
            p.entry = {**self._base(p), "status": records.SKIPPED,
                       "error": f"publishing fell behind and newer snapshots won ({first.name} is published instead)"}
            self._skipped.append(p)
        return first

    def _run(self, pub: Publication) -> None:
        with self._cond:
            skipped, self._skipped = self._skipped, []
        for p in skipped:
            self._keep(p, p.entry)
            self._done.put(p)
        if pub.kind == "snapshot":
            super()._run(pub)
        else:
            self._store_job(pub)

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

    def _start(self, pub: Publication) -> None:
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
        self._launch(pub, work, argv, env, ident, tail={"command": self.cfg.command} if self.cfg.command else None)

    def _finalize(self, pub: Publication) -> None:
        pub.entry = finalize(pub.path, self.destination, pub.running or {}, pub.stopped_after_s)

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

    def _unstarted(self, pub: Publication, waited: float) -> dict:
        return self._unfinished(pub, f"not started: the training ended first (after waiting {waited:.0f} s, "
                                     "publish.wait_at_end_s)")

    def _unfinished(self, pub: Publication, why: str) -> dict:
        return self._keep(pub, {**self._base(pub), "status": records.UNFINISHED,
                                "error": f"{why}; the next start, or `paddle-fullparam publish`, finishes it"})


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
    if not_recordable(entry, path, running, "published"):
        return entry
    records.write(path, destination, entry)
    if entry["status"] == records.OK and work.is_dir() and is_marked(work):
        delete_marked(work)
    return entry
