"""The consumers' hook base (consumers/hook.py), through a third consumer written here in a few lines (a
serving engine's weight reload): the line, the runner, the records, drain, wait-then-stop and adoption
are the base's; the consumer writes only its record, its argv and its final record."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from paddle_fullparam_callbacks.consumers.hook import RUNNER, ConsumerHook, Job, not_recordable, runner_alive, settle_left
from paddle_fullparam_callbacks.consumers.runner import STATUS, is_alive
from paddle_fullparam_callbacks.export.commit.ownership import snapshot_identity

RECORD = "fullparam_reload.json"
GATED = "import os, sys, time\nwhile not os.path.exists(sys.argv[2]): time.sleep(0.01)\nprint('reloaded', sys.argv[1])"


class Reload(ConsumerHook):
    """The third consumer: ``program SNAPSHOT GATE`` run on each snapshot, its record beside the manifest."""

    THREAD, FAULT, WHO = "test-reload-{}", "reload_running", "the reloader"
    WORKDIR, LOG = ".fullparam-reload", "fullparam_reload.log"
    POLL_S = 0.05  # an adopted runner is looked at this often

    def __init__(self, gate: Path, workers: int = 1, fail: bool = False):
        super().__init__(SimpleNamespace(timeout_s=60, nice=0), "r1", workers)
        self.gate, self.fail = gate, fail

    def _write(self, job, record):
        (job.path / RECORD).write_text(json.dumps(record))

    def _start(self, job):
        if self.fail:
            raise RuntimeError("no engine to reload")
        work = job.path / self.WORKDIR
        work.mkdir(exist_ok=True)
        argv = [sys.executable, "-c", GATED, str(job.path), str(self.gate)]
        self._launch(job, work, argv, {}, snapshot_identity(job.path), head={"engine": "test"})

    def _finalize(self, job):
        job.record = finalize(job)

    def _unstarted(self, job, waited):
        return self._keep(job, {**self._base(job), "status": "unfinished", "error": f"not started ({waited:.1f} s)"})


def finalize(job: Job) -> dict:
    status = json.loads((job.path / Reload.WORKDIR / STATUS).read_text())
    done = "unfinished" if status["terminated"] else "ok" if status["exit_code"] == 0 else "failed"
    record = {**job.running, "status": done, "last_line": status["last_line"]}
    if not not_recordable(record, job.path, job.running, "reloaded"):
        (job.path / RECORD).write_text(json.dumps(record))
    return record


def _snapshot(out: Path, step: int) -> Path:
    snap = out / f"hf-step-{step:06d}"
    snap.mkdir(parents=True)
    (snap / "fullparam_manifest.json").write_text(json.dumps({
        "manifest_version": 1, "step": step, "run": {"id": "r1", "seq": step}, "created_unix": time.time()}))
    return snap


def _on_disk(snap: Path) -> dict:
    return json.loads((snap / RECORD).read_text())


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_each_snapshot_runs_in_a_runner_and_is_recorded_and_drained(tmp_path):
    (tmp_path / "gate").write_text("open")
    hook = Reload(tmp_path / "gate", workers=2)
    snaps = [_snapshot(tmp_path, step) for step in (1, 2, 3)]
    for snap in snaps:
        hook.submit(Job(snap.name, snap, int(snap.name[-6:])))
    assert hook.busy() == {s.name for s in snaps}  # kept by retention until drained
    hook.close(60)
    done = sorted(hook.drain(), key=lambda j: j.step)
    assert [(j.name, j.status) for j in done] == [(s.name, "ok") for s in snaps]
    for job, snap in zip(done, snaps):
        assert _on_disk(snap) == job.record
        assert list(job.record)[:11] == ["snapshot", "step", "run", "status", "engine", "host", "pid", "started_unix",
                                         "timeout_s", "log", "identity"]
        assert (job.record["run"], job.record["log"], job.record["identity"]) == ("r1", Reload.LOG, snapshot_identity(snap))
        assert job.record["last_line"] == f"reloaded {snap}" and f"reloaded {snap}" in (snap / Reload.LOG).read_text()
        assert json.loads((snap / Reload.WORKDIR / "spec.json").read_text())["argv"][-1] == str(tmp_path / "gate")
    assert hook.busy() == set() and hook.pending() == 0 and hook.drain() == []
    assert sorted(t.name for t in hook._threads) == ["test-reload-0", "test-reload-1"]


def test_close_stops_the_running_job_records_the_line_and_refuses_more(tmp_path):
    hook = Reload(tmp_path / "gate")  # the gate never opens: the job runs until it is stopped
    first, second, late = (_snapshot(tmp_path, step) for step in (1, 2, 3))
    hook.submit(Job(first.name, first, 1))
    hook.submit(Job(second.name, second, 2))
    _wait(lambda: (first / RECORD).exists())
    assert _on_disk(first)["status"] == "running" and hook.pending() == 2
    hook.close(0.2)
    done = {j.name: j for j in hook.drain()}
    assert (done[first.name].status, done[first.name].stopped_after_s) == ("unfinished", 0.2)
    assert _on_disk(first) == done[first.name].record
    assert _on_disk(second) == done[second.name].record == {"snapshot": second.name, "step": 2, "run": "r1",
                                                             "status": "unfinished", "error": "not started (0.2 s)"}
    assert hook.submit(Job(late.name, late, 3)) == 0 and hook.busy() == set() and not (late / RECORD).exists()


def test_a_failure_of_the_hook_itself_is_recorded_not_raised(tmp_path):
    hook = Reload(tmp_path / "gate", fail=True)
    snap = _snapshot(tmp_path, 1)
    hook.submit(Job(snap.name, snap, 1))
    hook.close(60)
    (job,) = hook.drain()
    assert job.record == _on_disk(snap) == {"snapshot": snap.name, "step": 1, "run": "r1", "status": "failed",
                                            "error": "the reloader failed: RuntimeError: no engine to reload"}


def test_recovery_adopts_a_live_runner_and_records_an_ended_one(tmp_path):
    """An earlier job's runner, still working at this start, is adopted and recorded when it ends; one that
    has ended is recorded at once (settle_left, the recovery's entry point)."""
    gate = tmp_path / "gate"
    snap = _snapshot(tmp_path, 7)
    work = snap / Reload.WORKDIR
    work.mkdir()
    (work / "spec.json").write_text(json.dumps({"argv": [sys.executable, "-c", GATED, str(snap), str(gate)],
                                                "timeout_s": 60, "nice": 0, "log": str(snap / Reload.LOG)}))
    runner = subprocess.Popen([sys.executable, "-I", str(RUNNER), str(work)], start_new_session=True)
    _wait(lambda: is_alive(runner.pid, str(work)))
    left = {"snapshot": snap.name, "step": 7, "run": "r0", "status": "running", "pid": runner.pid,
            "identity": snapshot_identity(snap)}
    job = Job(snap.name, snap, 7, running=left, recovered=True)
    assert settle_left(job, work, runner_alive, lambda: finalize(job)) and job.adopted and job.record is None
    hook = Reload(gate)
    hook.adopt(job)
    assert hook.busy() == {snap.name}
    gate.write_text("open")
    hook.close(60)
    (adopted,) = hook.drain()
    runner.wait(30)
    assert adopted is job and job.status == "ok" and _on_disk(snap) == {**left, "status": "ok",
                                                                        "last_line": f"reloaded {snap}"}
    ended = Job(snap.name, snap, 7, running=left, recovered=True)
    assert not settle_left(ended, work, runner_alive, lambda: finalize(ended)) and not ended.adopted
    assert ended.status == "ok"
