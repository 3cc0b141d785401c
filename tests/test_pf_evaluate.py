"""The evaluation hook with the real PaddleFormers Trainer (single process): each committed snapshot
scored by a fake evaluator in a separate process while training goes on, the scores in the records
and in the trainer's logs, ``best`` following the downstream score, failures that never stop
training, retention while an evaluation runs, the end of training, ``paddle-fullparam evaluate``,
the checkpoint hook's snapshots, and a training job killed while an evaluation runs.
(The 4-rank launch is in tests/test_pf_multirank.py; the real perplexity evaluator in the demo's
recipe test.)"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach, verify_snapshot
from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.export.commit import evaluation as records
from paddle_fullparam_callbacks.export.commit.retention import list_snapshots
from paddle_fullparam_callbacks.plan.naming import snapshot_step_pattern

from _evaluators import Recorder, alive, calls, fake_evaluator, python_override, stop_leftovers, wait_until
from _helpers import listing, run_cli

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]
PATTERN = snapshot_step_pattern("hf-step-{step:06d}")


@pytest.fixture(autouse=True)
def _no_process_left(tmp_path):
    yield
    stop_leftovers(tmp_path)


def train(tmp_path, overrides, steps, recorder=None, use_attach=True, **args):
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 'snaps'}", python_override(), *overrides])
    targs = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, **{"save_steps": 100, **args})
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), targs, [recorder] if recorder else [])
    attach(trainer, cb) if use_attach else trainer.add_callback(cb)
    trainer.train()
    return cb, trainer


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


def test_each_snapshot_is_scored_logged_through_the_trainer_and_best_follows_the_score(tmp_path):
    scores = {"3": 5.0, "6": 1.0, "9": 4.0, "12": 3.0}
    command = fake_evaluator(tmp_path, {"scores": scores})
    rec = Recorder()
    cb, _ = train(tmp_path, [f"evaluate.command={command}", "trigger.every_n_steps=3", "retention.metric=evaluate.score",
                             "retention.keep_best=1", "retention.keep_last=1"], 12, rec)
    assert [(ev.step, ev.status, ev.scores["score"]) for ev in cb.evaluation.results] == [
        (3, "ok", 5.0), (6, "ok", 1.0), (9, "ok", 4.0), (12, "ok", 3.0)]
    # one evaluator process per snapshot, none of them the trainer's, all at lower priority
    ran = calls(tmp_path)
    assert sorted(c["step"] for c in ran) == [3, 6, 9, 12] and {c["nice"] for c in ran} == {10}
    assert os.getpid() not in {c["pid"] for c in ran}
    # the scores went through trainer.log, as the trainer's own metrics do
    assert [(e["fullparam/eval/snapshot_step"], e["fullparam/eval/score"]) for e in rec.logs] == [
        (3.0, 5.0), (6.0, 1.0), (9.0, 4.0), (12.0, 3.0)]
    # best follows the downstream score; keep_best=1 and keep_last=1 keep 6 and 12
    snaps = tmp_path / "snaps"
    assert listing(snaps) == ["best", name(6), name(12), "latest"]
    assert (snaps / "best").read_text().strip() == name(6)
    entries = {e.step: e for e in list_snapshots(snaps, PATTERN)}
    assert entries[6].metrics["evaluate.score"] == 1.0 and entries[12].metrics["evaluate.score"] == 3.0
    for step in (6, 12):
        snap = snaps / name(step)
        record = records.read_record(snap)
        assert record["status"] == "ok" and record["scores"]["score"] == float(scores[str(step)])
        assert record["command"].endswith(f"{snap} {step} {snap}/.fullparam-eval/output.json {tmp_path}/fake_eval.json")
        assert "evaluating" in (snap / records.LOG).read_text()  # stderr went to the snapshot's log
        assert verify_snapshot(snap).ok and not (snap / records.WORKDIR).exists()
        assert "metrics" in json.loads((snap / "fullparam_manifest.json").read_text())  # the manifest is as committed


def test_evaluator_failures_are_recorded_and_logged_once_and_never_stop_training(tmp_path, caplog):
    command = fake_evaluator(tmp_path, {"by_step": {"3": "crash", "6": "garbage", "9": "hang", "12": "stdout"}})
    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    cb, trainer = train(tmp_path, [f"evaluate.command={command}", "trigger.every_n_steps=3", "evaluate.timeout_s=2",
                                   "evaluate.max_concurrent=2"], 12, use_attach=False)
    assert trainer.state.global_step == 12 and cb.events == [f"every_n_steps@{s}" for s in (3, 6, 9, 12)]
    got = {ev.step: ev.record for ev in cb.evaluation.results}
    assert (got[3]["status"], got[3]["error"]) == ("failed", "exit status 3") and "boom" in got[3]["log_tail"]
    assert got[6]["status"] == "failed" and got[6]["error"].startswith("unreadable result: {output} is not JSON")
    assert (got[9]["status"], got[9]["error"]) == ("timeout", "stopped after evaluate.timeout_s=2.0 s")
    assert got[12]["status"] == "ok" and got[12]["scores"]["score"] == pytest.approx(100 / 12)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "evaluation of" in r.getMessage()]
    assert len(warnings) == 3 and all("training continues, the snapshot stays" in w for w in warnings)
    snaps = tmp_path / "snaps"
    for step in (3, 6, 9, 12):  # every snapshot stays, verifies, and carries its record
        assert verify_snapshot(snaps / name(step)).ok
        assert records.read_record(snaps / name(step)) == {"evaluation_version": 1, **got[step]}
    assert not alive(next(c["pid"] for c in calls(tmp_path) if c["step"] == 9))


def test_retention_keeps_snapshots_whose_evaluation_runs_or_waits(tmp_path):
    gate = tmp_path / "gate-{step}"
    command = fake_evaluator(tmp_path, {"by_step": {"2": "gate"}, "gate": str(gate)})
    seen = {}

    def at_7():  # 2 is being evaluated (its evaluator waits), 4 and 6 wait in line: all kept despite keep_last=1
        snaps = tmp_path / "snaps"
        seen["listing"] = listing(snaps)
        seen["record"] = records.read_record(snaps / name(2))
        Path(str(gate).replace("{step}", "2")).write_text("go")

    cb, _ = train(tmp_path, [f"evaluate.command={command}", "trigger.every_n_steps=2", "retention.keep_last=1"], 8,
                  Recorder({7: at_7}))
    assert seen["listing"] == [name(2), name(4), name(6), "latest"] and seen["record"]["status"] == "running"
    assert [(ev.step, ev.status) for ev in cb.evaluation.results] == [(2, "ok"), (4, "ok"), (6, "ok"), (8, "ok")]
    assert listing(tmp_path / "snaps") == [name(8), "latest"]  # once evaluated, retention applies as usual


def test_the_end_waits_a_bound_then_records_unfinished_and_evaluate_fills_them_in(tmp_path):
    command = fake_evaluator(tmp_path, {"default": "hang"})
    cb, _ = train(tmp_path, [f"evaluate.command={command}", "trigger.every_n_steps=2", "evaluate.wait_at_end_s=0"], 4)
    snaps = tmp_path / "snaps"
    got = {ev.step: ev.record for ev in cb.evaluation.results}
    assert got[2]["status"] == "unfinished" and got[2]["error"].startswith("stopped: the training ended before it finished")
    assert got[4]["status"] == "unfinished" and got[4]["error"].startswith("not started: the training ended first")
    assert not any(alive(c["pid"]) for c in calls(tmp_path))
    assert {records.read_record(snaps / name(s))["status"] for s in (2, 4)} == {"unfinished"}
    # afterwards, the same hook from the command line: the unfinished ones, then best by the score
    ok = fake_evaluator(tmp_path, {"scores": {"2": 0.5, "4": 0.9}}, name="ok_eval")
    proc = run_cli("evaluate", str(snaps), f"evaluate.command={ok}", python_override(),
                   "retention.metric=evaluate.score", "retention.mode=max")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "evaluating 2 of 2 snapshot(s)" in proc.stdout and "best -> hf-step-000004 (by evaluate.score, max)" in proc.stdout
    assert {records.read_record(snaps / name(s))["scores"]["score"] for s in (2, 4)} == {0.5, 0.9}
    again = run_cli("evaluate", str(snaps / name(2)), f"evaluate.command={ok}", python_override())
    assert again.returncode == 0 and "evaluating 0 of 1 snapshot(s)" in again.stdout
    assert verify_snapshot(snaps / name(2)).ok and (snaps / "best").read_text().strip() == name(4)


def test_the_checkpoint_hooks_snapshots_are_evaluated_the_same_way(tmp_path):
    command = fake_evaluator(tmp_path, {})
    rec = Recorder()
    cb = attach(make_trainer("paddleformers", make_tiny_llama(seed=0),
                             trainer_args("paddleformers", str(tmp_path / "trainer"), 6, save_steps=3), [rec]),
                "checkpoint_hook", overrides=[f"evaluate.command={command}", python_override()])
    cb.trainer.train()
    assert [(ev.name, ev.status) for ev in cb.evaluation.results] == [("checkpoint-3/hf", "ok"), ("checkpoint-6/hf", "ok")]
    for step in (3, 6):
        snap = tmp_path / "trainer" / f"checkpoint-{step}" / "hf"
        assert records.read_record(snap)["scores"]["score"] == pytest.approx(100 / step) and verify_snapshot(snap).ok
    assert [e["fullparam/eval/snapshot_step"] for e in rec.logs] == [3.0, 6.0]


KILLED_JOB = r"""
import sys
from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args
out, command = sys.argv[1], sys.argv[2]
cb = FullParamExportCallback(None, overrides=[f"output_dir={out}/snaps", f"evaluate.command={command}",
                                              f"evaluate.python={sys.executable}", "trigger.every_n_steps=2"])
trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), trainer_args("paddleformers", f"{out}/trainer", 400,
                       save_steps=1000), [])
attach(trainer, cb)
trainer.train()
"""


def test_a_job_killed_while_an_evaluation_runs_gets_its_result_recorded_at_the_next_start(tmp_path):
    command = fake_evaluator(tmp_path, {"default": "gate", "gate": str(tmp_path / "gate-{step}"), "scores": {"2": 7.0}})
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "notes.txt").write_text("the user's")
    env = {**os.environ, "PFC_FAULT_POINT": "evaluate_running"}  # SIGKILL once the first evaluation is running
    proc = subprocess.run([sys.executable, "-c", KILLED_JOB, str(tmp_path), command], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    running = records.read_record(snaps / name(2))
    assert running["status"] == "running" and alive(running["pid"])  # the runner outlived the job
    kept = {p: p.read_bytes() for p in (snaps / name(2)).iterdir() if p.is_file() and p.name not in (records.RECORD, records.LOG)}
    Path(tmp_path / "gate-2").write_text("go")
    wait_until(lambda: not alive(running["pid"]), f"the runner (pid {running['pid']}) to end", every_s=0.05)
    # the next start (a new job into the same directory) records the result the runner left
    cb, _ = train(tmp_path, [f"evaluate.command={fake_evaluator(tmp_path, {}, name='next')}",
                             "trigger.every_n_steps=100", "trigger.on_train_end=false"], 1)
    record = records.read_record(snaps / name(2))
    assert record["status"] == "ok" and record["scores"]["score"] == 7.0 and record["pid"] == running["pid"]
    assert [(ev.name, ev.recovered, ev.status) for ev in cb.evaluation.results] == [(name(2), True, "ok")]
    assert not (snaps / name(2) / records.WORKDIR).exists() and verify_snapshot(snaps / name(2)).ok
    assert {p: p.read_bytes() for p in kept} == kept and (snaps / "notes.txt").read_text() == "the user's"
    assert "evaluating" in (snaps / name(2) / records.LOG).read_text()


def test_four_ranks_evaluate_and_serve_each_snapshot_once_on_the_coordinator(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
    import harness
    from _engine import FakeVLLM

    command = fake_evaluator(tmp_path, {"scores": {"2": 0.2, "4": 0.9, "6": 0.4, "8": 0.1}})
    engine = FakeVLLM()
    try:
        res = harness.run_launch(Path(__file__).resolve().parent / "multirank" / "evaluate_job.py",
                                 ["--out", tmp_path, "--command", command, "--python", sys.executable, "--engine",
                                  engine.url], nproc=4, log_dir=tmp_path / "log", timeout=300)
    finally:
        engine.stop()
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = {r: rep for r, rep in res.tagged("EVAL")}
    assert sorted(reports) == [0, 1, 2, 3] and all(rep["world"] == 4 and rep["errors"] == [] for rep in reports.values())
    assert all(rep["events"] == [f"every_n_steps@{s}" for s in (2, 4, 6, 8)] for rep in reports.values())
    assert len({json.dumps(rep["decisions"]) for rep in reports.values()}) == 1  # the same decisions everywhere
    # once per snapshot, by the coordinator (rank 0's environment), never by the other ranks
    ran = calls(tmp_path)
    assert sorted(c["step"] for c in ran) == [2, 4, 6, 8] and {c["rank"] for c in ran} == {"0"}
    assert reports[0]["results"] == [[name(s), "ok", v] for s, v in ((2, 0.2), (4, 0.9), (6, 0.4), (8, 0.1))]
    assert [e["fullparam/eval/score"] for e in reports[0]["logged"]] == [0.2, 0.9, 0.4, 0.1]
    assert all(rep["results"] == [] and rep["logged"] == [] for r, rep in reports.items() if r)
    snaps = tmp_path / "snaps"
    assert listing(snaps) == ["best", name(4), name(8), "latest"] and (snaps / "best").read_text().strip() == name(4)
    assert verify_snapshot(snaps / name(4)).ok and records.read_record(snaps / name(4))["scores"]["score"] == 0.9
    # serving: one rank drove the engine, one swap per snapshot it took, the newest last; none skipped here is lost
    served = reports[0]["served"]
    assert all(rep["served"] == [] for r, rep in reports.items() if r) and served[-1] == [name(8), "ok"]
    reloads = [b["kwargs"]["weights_path"] for m, p, b, _ in engine.calls if p == "/collective_rpc" and b.get("kwargs")]
    assert [Path(r).name for r in reloads] == [n for n, status in served if status == "ok"]
    assert {status for _, status in served} <= {"ok", "skipped"} and engine.state()["version"] == name(8)
    assert engine.paths("POST").count("/pause?mode=keep") == len(reloads)
