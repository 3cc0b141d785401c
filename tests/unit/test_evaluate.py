"""The evaluation hook's parts, without a trainer: the recipe keys and their rules, the evaluator's
argv, the record and what retention makes of it, and the hook itself on fake snapshots with tiny
fake evaluators (ok, crash, timeout, garbage, the end of training, a killed job's leftovers)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _evaluators import alive, calls, fake_evaluator, stop_leftovers, wait_until  # noqa: E402

from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.config.schema import ConfigError, EvaluateConfig  # noqa: E402
from paddle_fullparam_callbacks.export.commit import evaluation as records  # noqa: E402
from paddle_fullparam_callbacks.export.commit.ownership import MARKER  # noqa: E402
from paddle_fullparam_callbacks.export.commit.retention import apply_retention, list_snapshots, update_best  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate import Evaluation, EvaluationHook, build_argv, recover, resolve_python  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate.result import final_record, flatten, read_result  # noqa: E402
from paddle_fullparam_callbacks.plan.naming import snapshot_step_pattern  # noqa: E402

PATTERN = snapshot_step_pattern("hf-step-{step:06d}")
PY = [sys.executable]


@pytest.fixture(autouse=True)
def _no_process_left(tmp_path):
    yield
    stop_leftovers(tmp_path)


# ---- recipe keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["evaluate.command=x", "evaluate.callable=a:b"], r"^evaluate.callable: is set together with evaluate.command"),
    (["evaluate.command=run {snap}"], r"^evaluate.command: 'run' .*|^evaluate.command: '\{snap\}': unknown field \{snap\}"),
    (["evaluate.command=x {step:06d}"], r"^evaluate.command: '\{step:06d\}': unknown field \{step:06d\}; the command may use "
                                        r"\{snapshot\}, \{step\}, \{output\}, \{python\}$"),
    (["evaluate.command=a 'b"], r"^evaluate.command: does not split into words"),
    (["evaluate.command=' '"], r"^evaluate.command: is empty"),
    (["evaluate.callable=nocolon"], r"^evaluate.callable: must be 'package.module:function'"),
    (["evaluate.python=$9-x"], r"^evaluate.python: '\$9-x': \$NAME must name an environment variable"),
    (["evaluate.command=x", "evaluate.every=-1"], r"^evaluate.every: must be a whole number >= 0; got -1$"),
    (["evaluate.command=x", "evaluate.every=0", "evaluate.last=false"], r"^evaluate.every: is 0 and evaluate.last is false"),
    (["evaluate.max_concurrent=0"], r"^evaluate.max_concurrent: must be a whole number >= 1; got 0$"),
    (["evaluate.timeout_s=0"], r"^evaluate.timeout_s: must be a number of seconds > 0; got 0.0$"),
    (["evaluate.wait_at_end_s=-1"], r"^evaluate.wait_at_end_s: must be a number of seconds >= 0"),
    (["evaluate.nice=20"], r"^evaluate.nice: must be a whole number >= 0 and <= 19; got 20$"),
    (["retention.metric=evaluate.score"], r"^retention.metric: 'evaluate.score' follows a score of the evaluation hook, "
                                          r"but neither evaluate.command, evaluate.callable nor evaluate.lm_eval.tasks is set$"),
    (["evaluate.command=x", "export.format=callable", "export.callable=a:b"],
     r"^evaluate.command: export.format=callable writes no snapshot to evaluate$"),
])
def test_bad_evaluate_keys_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_evaluate_keys_load_with_their_defaults_and_a_command_from_the_command_line():
    cfg = load_config(None, ["evaluate.command={python} -m ev {snapshot} --output {output}",
                             "retention.metric=evaluate.perplexity", "evaluate.python=$PFC_HF_PYTHON"]).evaluate
    assert cfg.command == "{python} -m ev {snapshot} --output {output}" and cfg.python == "$PFC_HF_PYTHON"
    assert (cfg.every, cfg.last, cfg.max_concurrent, cfg.nice) == (1, True, 1, 10) and cfg.enabled
    assert not load_config(None).evaluate.enabled
    assert load_config("evaluate_each_snapshot").retention.metric == "evaluate.perplexity"


def test_the_interpreter_is_found_once_or_refused_naming_the_key(tmp_path):
    cfg = EvaluateConfig(command="x", python="$PFC_TEST_PY")
    assert resolve_python(cfg, {"PFC_TEST_PY": sys.executable}) == [sys.executable]
    assert resolve_python(EvaluateConfig(command="x"), {}) == [sys.executable]
    assert resolve_python(EvaluateConfig(command="x", python=f"{sys.executable} -X utf8"), {}) == [sys.executable, "-X", "utf8"]
    with pytest.raises(ConfigError, match=r"^evaluate.python: \$PFC_TEST_PY is not set in this job's environment"):
        resolve_python(cfg, {})
    with pytest.raises(ConfigError, match=r"^evaluate.python: '/nonexistent/python' is not an executable file"):
        resolve_python(EvaluateConfig(command="x", python="/nonexistent/python"), {})


def test_the_command_is_split_then_filled_so_paths_with_spaces_stay_one_word():
    cfg = EvaluateConfig(command="{python} ev.py {snapshot} --step={step} --out {output}")
    argv = build_argv(cfg, ["/env/bin/python"], Path("/o/my snaps/hf-step-000010"), 10, Path("/o/x y/out.json"))
    assert argv == ["/env/bin/python", "ev.py", "/o/my snaps/hf-step-000010", "--step=10", "--out", "/o/x y/out.json"]
    argv = build_argv(EvaluateConfig(callable="pkg.mod:fn"), PY, Path("/s"), 3, Path("/o"))
    assert argv[0] == sys.executable and argv[1] == "-c" and argv[3:] == ["pkg.mod:fn", "/s", "3", "/o"]


# ---- results and records ----------------------------------------------------------------------
RUNNING = {"snapshot": "hf-step-000003", "step": 3, "status": "running", "timeout_s": 5.0, "pid": 1, "host": "h"}


def test_results_become_records(tmp_path):
    out = tmp_path / "output.json"
    ok = {"exit_code": 0, "last_line": "", "seconds": 1.5}
    out.write_text(json.dumps({"perplexity": 12.5, "results": {"hs": {"acc": 0.25, "name": "x"}}, "flag": True}))
    r = final_record(RUNNING, ok, out)
    assert r["status"] == "ok" and r["scores"] == {"perplexity": 12.5, "results/hs/acc": 0.25} and r["seconds"] == 1.5
    out.unlink()
    r = final_record(RUNNING, {**ok, "last_line": '{"score": 3}'}, out)  # the last line on stdout
    assert (r["status"], r["scores"]) == ("ok", {"score": 3.0})
    cases = [
        ({**ok, "exit_code": 3}, "failed", "exit status 3"),
        ({**ok, "exit_code": -9}, "failed", "killed by signal 9"),
        ({**ok, "exit_code": -15, "timed_out": True}, "timeout", "stopped after evaluate.timeout_s=5.0 s"),
        ({**ok, "exit_code": -15, "terminated": True}, "unfinished", "stopped: the training ended before it finished"),
        ({**ok, "error": "cannot start 'nope': No such file"}, "failed", "cannot start 'nope'"),
        ({**ok, "last_line": "3.7"}, "failed", "unreadable result: the last line on stdout is JSON float, not an object"),
        ({**ok, "last_line": "loss went down"}, "failed", "unreadable result: the last line on stdout is not JSON"),
        (ok, "failed", "unreadable result: no result: nothing written to {output} and nothing printed on stdout"),
        (None, "unfinished", "the evaluation's process ended without a result"),
    ]
    for status, expect, error in cases:
        r = final_record(RUNNING, status, out, log_tail="boom")
        assert r["status"] == expect and error in r["error"], (status, r)
        assert "scores" not in r and (r.get("log_tail") == "boom" or status is None)
    out.write_text("not json {")
    assert "{output} is not JSON" in final_record(RUNNING, ok, out)["error"]
    out.write_text("x" * 1_000_001)
    assert read_result(out, "")[1] == "{output} holds 1000001 bytes (at most 1000000)"
    assert flatten({"a": {"b": {"c": 1}}, "inf": float("inf")}) == {"a/b/c": 1.0}


def _snapshot(out: Path, step: int, run="r1", seq=None) -> Path:
    snap = out / f"hf-step-{step:06d}"
    snap.mkdir(parents=True)
    (snap / "fullparam_manifest.json").write_text(json.dumps({
        "manifest_version": 1, "step": step, "run": {"id": run, "seq": seq or step}, "created_unix": time.time(),
        "metrics": {}, "files": {}}))
    return snap


def test_records_are_replaced_atomically_and_ranked_by_retention(tmp_path):
    out = tmp_path / "out"
    snaps = {s: _snapshot(out, s) for s in (1, 2, 3, 4)}
    records.write_record(snaps[1], {"status": "ok", "scores": {"score": 5.0}})
    records.write_record(snaps[2], {"status": "ok", "scores": {"score": 1.0}})
    records.write_record(snaps[3], {"status": "running", "pid": 1})
    (snaps[4] / records.RECORD).write_text("{half")  # not a record: ignored
    assert sorted(p.name for p in snaps[1].iterdir()) == ["fullparam_evaluation.json", "fullparam_manifest.json"]
    entries = {e.step: e for e in list_snapshots(out, PATTERN)}
    assert entries[1].metrics == {"evaluate.score": 5.0} and entries[2].metrics == {"evaluate.score": 1.0}
    assert [s for s, e in entries.items() if e.evaluating] == [3] and entries[4].metrics == {}
    assert update_best(out, PATTERN, "evaluate.score", "min", "r1") == "hf-step-000002"
    # keep the newest and the best: 1 goes; 3 is being evaluated and stays
    assert apply_retention(out, PATTERN, keep_last=1, keep_best=1, metric="evaluate.score", run_id="r1") == ["hf-step-000001"]
    assert sorted(p.name for p in out.iterdir()) == ["best", "hf-step-000002", "hf-step-000003", "hf-step-000004"]
    (snaps[2] / (records.RECORD_TMP + "abcd1234")).write_text("{")  # a crash between write and rename
    records.remove_leftover_tmp(snaps[2])
    assert records.read_record(snaps[2])["scores"] == {"score": 1.0}
    assert not list(snaps[2].glob(records.RECORD_TMP + "*"))


# ---- the hook on fake snapshots ---------------------------------------------------------------
def _hook(tmp_path, plan, **keys) -> EvaluationHook:
    command = fake_evaluator(tmp_path, plan)
    return EvaluationHook(EvaluateConfig(command=command, **keys), PY, run_id="r1")


def test_the_hook_evaluates_every_kth_commit_and_the_last_at_lower_priority(tmp_path):
    out = tmp_path / "out"
    hook = _hook(tmp_path, {"by_step": {"2": "stdout"}}, every=2, last=True, max_concurrent=2)
    for step in (1, 2, 3, 4, 5):
        hook.committed(f"hf-step-{step:06d}", _snapshot(out, step), step)
    hook.training_ended()  # 5 is the last: evaluated too
    hook.close(wait_s=60)
    done = sorted(hook.drain(), key=lambda ev: ev.step)
    assert [(ev.step, ev.status) for ev in done] == [(2, "ok"), (4, "ok"), (5, "ok")]
    assert [ev.scores["score"] for ev in done] == [50.0, 25.0, 20.0] and hook.busy() == set()
    # the evaluator yields the CPU to training: 10 more than the job's own nice value (capped by the OS at 19)
    assert {c["nice"] for c in calls(tmp_path)} == {min(19, os.nice(0) + 10)}
    # ... also where Linux schedules sessions as groups (autogroup): its group's nice value is 10 too
    groups = {c["autogroup"] for c in calls(tmp_path)}
    assert groups == {None} or all(g.endswith(" nice 10") for g in groups), groups
    for ev in done:
        rec = records.read_record(ev.path)
        assert rec["status"] == "ok" and rec["step"] == ev.step and rec["exit_code"] == 0
        assert "evaluating" in (ev.path / records.LOG).read_text() or ev.step == 2
        assert not (ev.path / records.WORKDIR).exists()  # the work folder is gone
    assert "some progress line" in (out / "hf-step-000002" / records.LOG).read_text()  # stdout goes to the log too
    assert records.read_record(out / "hf-step-000001") is None


def test_failures_are_recorded_not_raised(tmp_path):
    out = tmp_path / "out"
    plan = {"by_step": {"1": "crash", "2": "garbage", "3": "hang", "4": "list"}}
    hook = _hook(tmp_path, plan, timeout_s=1.0, max_concurrent=4)
    for step in (1, 2, 3, 4):
        hook.committed(f"hf-step-{step:06d}", _snapshot(out, step), step)
    hook.close(wait_s=120)
    got = {ev.step: ev.record for ev in hook.drain()}
    assert got[1]["status"] == "failed" and got[1]["error"] == "exit status 3" and "boom" in got[1]["log_tail"]
    assert got[2]["status"] == "failed" and got[2]["error"].startswith("unreadable result: {output} is not JSON")
    assert got[3]["status"] == "timeout" and got[3]["error"] == "stopped after evaluate.timeout_s=1.0 s"
    assert got[4]["status"] == "failed" and "JSON list, not an object" in got[4]["error"]
    assert all(records.read_record(out / f"hf-step-{s:06d}") == {"evaluation_version": 1, **got[s]} for s in got)
    hung = next(c for c in calls(tmp_path) if c["step"] == 3)
    assert not alive(hung["pid"])  # the timed-out evaluator's process group was stopped


def test_the_end_of_training_stops_what_is_left_as_unfinished(tmp_path):
    out = tmp_path / "out"
    hook = _hook(tmp_path, {"default": "hang"}, max_concurrent=1)
    for step in (1, 2):
        hook.committed(f"hf-step-{step:06d}", _snapshot(out, step), step)
    wait_until(lambda: calls(tmp_path), "the first evaluator to start")  # (the second waits in line)
    assert hook.busy() == {"hf-step-000001", "hf-step-000002"}
    hook.close(wait_s=0)
    got = {ev.step: ev.record for ev in hook.drain()}
    assert got[1]["status"] == "unfinished" and got[1]["error"].startswith("stopped: the training ended before it finished")
    assert got[2]["status"] == "unfinished" and got[2]["error"].startswith("not started: the training ended first")
    assert records.read_record(out / "hf-step-000001")["status"] == "unfinished"
    assert not alive(calls(tmp_path)[0]["pid"]) and len(calls(tmp_path)) == 1


def test_a_killed_jobs_evaluation_is_recorded_or_marked_unfinished_at_the_next_start(tmp_path):
    """The job dies after starting two runners: one finishes on its own (recorded at the next start),
    one is killed with it (unfinished); a third still runs at the next start (adopted, recorded when it
    ends). Nothing else in the snapshots is touched."""
    out = tmp_path / "out"
    command = fake_evaluator(tmp_path, {"default": "gate", "gate": str(tmp_path / "gate-{step}")})
    snaps = {s: _snapshot(out, s) for s in (1, 2, 3)}
    (snaps[1] / "user.txt").write_text("mine")
    job = subprocess.Popen([sys.executable, "-c", JOB, command, str(out)], stdout=subprocess.PIPE, text=True)
    line = job.stdout.readline()  # the job prints its runners' pids, then is killed
    assert line, f"the job ended before its runners ran (exit {job.wait()})"
    runners = json.loads(line)
    wait_until(lambda: len(calls(tmp_path)) >= 3, f"every evaluator to start: {calls(tmp_path)}")
    job.kill()
    job.wait()
    ours = (records.RECORD, records.LOG)  # the evaluation's own files; everything else must stay as it was
    before = {p: p.read_bytes() for s in snaps.values() for p in s.rglob("*") if p.is_file() and ".fullparam-eval" not in str(p)
              and p.name not in ours}
    assert all(records.read_record(s)["status"] == "running" for s in snaps.values())
    os.kill(runners["2"], signal.SIGKILL)  # killed with the job: no status
    (tmp_path / "gate-1").write_text("go")  # 1 finishes after the job died; 3 keeps waiting: still running at the next start
    for step in ("1", "2"):
        wait_until(lambda: not alive(runners[step]), f"runner {step} (pid {runners[step]}) to end")
    hook = EvaluationHook(EvaluateConfig(command=command), PY, run_id="r2")
    settled, alive_now = recover([(s.name, step, s, True) for step, s in snaps.items()], hook)
    assert {ev.step: ev.status for ev in settled} == {1: "ok", 2: "unfinished"} and [ev.step for ev in alive_now] == [3]
    assert records.read_record(snaps[1])["scores"]["score"] == 100.0
    assert "ended without a result" in records.read_record(snaps[2])["error"]
    orphan = next(c["pid"] for c in calls(tmp_path) if c["step"] == 2)
    # its evaluator, left without its runner, was stopped (provably ours: PFC_OUTPUT)
    wait_until(lambda: not alive(orphan), f"the orphaned evaluator (pid {orphan}) to be stopped")
    assert hook.busy() == {"hf-step-000003"}  # adopted: retention keeps it
    (tmp_path / "gate-3").write_text("go")
    hook.close(wait_s=60)
    assert [(ev.step, ev.status) for ev in hook.drain()] == [(3, "ok")]
    assert records.read_record(snaps[3])["scores"]["score"] == pytest.approx(100 / 3)
    after = {p: p.read_bytes() for s in snaps.values() for p in s.rglob("*") if p.is_file() and p.name not in ours}
    assert after == before and not any((s / records.WORKDIR).exists() for s in snaps.values())
    assert not list(out.rglob(MARKER))


JOB = r"""
import json, sys, time
from pathlib import Path
from paddle_fullparam_callbacks.config.schema import EvaluateConfig
from paddle_fullparam_callbacks.export.commit import evaluation as records
from paddle_fullparam_callbacks.consumers.evaluate import EvaluationHook
command, out = sys.argv[1], Path(sys.argv[2])
hook = EvaluationHook(EvaluateConfig(command=command, max_concurrent=3), [sys.executable], run_id="r1")
for step in (1, 2, 3):
    hook.committed(f"hf-step-{step:06d}", out / f"hf-step-{step:06d}", step)
pids, deadline = {}, time.monotonic() + 120
while len(pids) < 3:
    if time.monotonic() > deadline:
        sys.exit(f"the runners did not all record themselves as running: {pids}")
    for step in (1, 2, 3):
        r = records.read_record(out / f"hf-step-{step:06d}")
        if r and r["status"] == "running":
            pids[str(step)] = r["pid"]
    time.sleep(0.02)
print(json.dumps(pids), flush=True)
time.sleep(3600)
"""


def test_a_snapshot_replaced_while_evaluated_does_not_get_the_old_score(tmp_path):
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    hook = _hook(tmp_path, {"default": "gate", "gate": str(gate)})
    snap = _snapshot(out, 1)
    hook.committed("hf-step-000001", snap, 1)
    wait_until(lambda: calls(tmp_path), "the evaluator to start")
    manifest = json.loads((snap / "fullparam_manifest.json").read_text())
    (snap / "fullparam_manifest.json").write_text(json.dumps({**manifest, "run": {"id": "r1", "seq": 9}}))
    gate.write_text("go")
    hook.close(wait_s=60)
    (ev,) = hook.drain()
    assert ev.record["recorded"] is False and "replaced while it was evaluated" in ev.record["error"]
    assert records.read_record(snap)["status"] == "running"  # the new snapshot's record is not the old one's result


def test_a_callable_runs_in_the_evaluators_interpreter_and_returns_its_result(tmp_path, monkeypatch):
    (tmp_path / "my_scores.py").write_text(
        "import os\n"
        "def score(snapshot, step, output):\n"
        "    return {'score': step * 2, 'pid': os.getpid(), 'nice': os.nice(0)}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    hook = EvaluationHook(EvaluateConfig(callable="my_scores:score", nice=5), PY, run_id="r1")
    hook.committed("hf-step-000004", _snapshot(tmp_path / "out", 4), 4)
    hook.close(wait_s=60)
    (ev,) = hook.drain()
    assert ev.status == "ok" and ev.scores["score"] == 8.0 and ev.scores["nice"] == min(19, os.nice(0) + 5) and ev.scores["pid"] != os.getpid()
    assert records.read_record(ev.path)["command"].startswith(f"{sys.executable} -c '<bootstrap>' my_scores:score ")


def test_evaluate_afterwards_fills_in_and_leaves_a_live_jobs_directory_to_it(tmp_path):
    from paddle_fullparam_callbacks.export.commit.lock import acquire_lock
    from paddle_fullparam_callbacks.consumers.evaluate.offline import evaluate_path

    out = tmp_path / "out"
    snaps = {s: _snapshot(out, s) for s in (1, 2, 3)}
    records.write_record(snaps[1], {"status": "failed", "error": "exit status 3"})
    records.write_record(snaps[2], {"status": "unfinished", "error": "stopped"})
    command = fake_evaluator(tmp_path, {"scores": {"1": 0.5, "2": 0.1, "3": 0.3}})
    cfg = load_config(None, [f"evaluate.command={command}", f"evaluate.python={sys.executable}",
                             "retention.metric=evaluate.score", "retention.mode=max"])
    said = []
    job = acquire_lock(out, owner="a training job")  # a live job writes here: it keeps its evaluations and best
    try:
        done = evaluate_path(out, cfg, say=said.append)
    finally:
        job.release()
    assert [(ev.step, ev.status) for ev in done] == [(3, "ok")] and not (out / "best").exists()
    assert any("its own hook evaluates what it runs" in s for s in said) and said[-1].startswith("best: not updated")
    done = evaluate_path(out, cfg, say=said.append)  # the job has ended: the unfinished one, then best
    assert [(ev.step, ev.status) for ev in done] == [(2, "ok")] and said[-1] == "best -> hf-step-000003 (by evaluate.score, max)"
    done = evaluate_path(out, cfg, redo="failed", say=said.append)
    assert [(ev.step, ev.status) for ev in done] == [(1, "ok")] and said[-1] == "best -> hf-step-000001 (by evaluate.score, max)"
    assert not (out / ".fullparam.lock").exists()
