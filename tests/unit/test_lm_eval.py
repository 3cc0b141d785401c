"""The bundled lm-eval evaluator's parts without a trainer (issue 41): the ``evaluate.lm_eval`` rules, the scores'
names, the evaluator's argv, a discarded result and a failure's own words in the record, ``best`` by a metric with
a filter in its name, the engine's served version (waited for, watched) against the vLLM stand-in, and the start's
probe in the real evaluation environment (``hf``: lm-eval installed) and in one without the harness. The real
runs, on transformers and on a real vLLM server, are in ``tests/test_pf_lm_eval.py``."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine import FakeVLLM  # noqa: E402

from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.config.consumers import LmEvalConfig  # noqa: E402
from paddle_fullparam_callbacks.config.schema import ConfigError  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate import check_lm_eval  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate.command import build_argv, describe_evaluator  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate.lmeval import engine as eng  # noqa: E402
from paddle_fullparam_callbacks.consumers.evaluate.lmeval.spec import (  # noqa: E402
    MODULE, RESULTS, build_spec, bundled_tasks, metric_scores)
from paddle_fullparam_callbacks.consumers.evaluate.result import final_record  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve import records as serve_records  # noqa: E402
from paddle_fullparam_callbacks.export.commit import evaluation as records  # noqa: E402
from paddle_fullparam_callbacks.export.commit.retention import list_snapshots, update_best  # noqa: E402
from paddle_fullparam_callbacks.plan.naming import snapshot_step_pattern  # noqa: E402

TASKS = "evaluate.lm_eval.tasks=[pfc_choice,pfc_generate]"
SERVE = "serve.url=[http://127.0.0.1:9,http://127.0.0.1:10]"
PATTERN = snapshot_step_pattern("hf-step-{step:06d}")


@pytest.mark.parametrize("overrides, message", [
    (["evaluate.lm_eval.tasks=[a,a]"], r"^evaluate.lm_eval.tasks: names 'a' twice; got \['a', 'a'\]$"),
    (["evaluate.lm_eval.tasks=['a,b']"], r"^evaluate.lm_eval.tasks: 'a,b' is not a task name \(one word, no commas\)"),
    (["evaluate.lm_eval.backend=engine"], r"^evaluate.lm_eval.tasks: is empty, but evaluate.lm_eval.backend is set: "
                                          r"name the tasks to run"),
    ([TASKS, "evaluate.lm_eval.backend=vllm"], r"^evaluate.lm_eval.backend: must be one of hf, engine; got 'vllm'$"),
    ([TASKS, "evaluate.lm_eval.limit=1.5"], r"^evaluate.lm_eval.limit: must be a number of documents per task"),
    ([TASKS, "evaluate.lm_eval.limit=0"], r"^evaluate.lm_eval.limit: must be a number of documents per task"),
    ([TASKS, "evaluate.lm_eval.num_fewshot=-1"], r"^evaluate.lm_eval.num_fewshot: must be a whole number >= 0; got -1 "
                                                 r"\(or null: each task's own\)$"),
    ([TASKS, "evaluate.lm_eval.batch_size=0"], r"^evaluate.lm_eval.batch_size: must be a whole number >= 1; got 0$"),
    ([TASKS, "evaluate.lm_eval.include_path=''"], r"^evaluate.lm_eval.include_path: must be a folder of task files"),
    ([TASKS, "evaluate.command=x {snapshot}"], r"^evaluate.lm_eval.tasks: is set together with evaluate.command: give "
                                               r"one evaluator"),
    ([TASKS, "evaluate.lm_eval.backend=engine"], r"^evaluate.lm_eval.backend: engine scores each snapshot on the engine "
                                                 r"that serves it, but the recipe has no serve section: set serve.url"),
    ([TASKS, "evaluate.lm_eval.engine_url=http://127.0.0.1:9"], r"^evaluate.lm_eval.engine_url: is set, but "
                                                                r"evaluate.lm_eval.backend is hf"),
    ([TASKS, SERVE, "evaluate.lm_eval.backend=engine", "evaluate.lm_eval.engine_url=http://127.0.0.1:11"],
     r"^evaluate.lm_eval.engine_url: http://127.0.0.1:11 is not one of serve.url \(http://127.0.0.1:9, "
     r"http://127.0.0.1:10\)"),
    ([TASKS, "evaluate.lm_eval.engine_wait_s=-1"], r"^evaluate.lm_eval.engine_wait_s: must be a number >= 0; got -1"),
])
def test_bad_lm_eval_keys_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_engine_backend_scores_on_the_first_engine_served_unless_told(tmp_path):
    cfg = load_config(None, [TASKS, SERVE, "evaluate.lm_eval.backend=engine", "serve.api_key_env=KEY_VAR"])
    assert cfg.evaluate.enabled and cfg.evaluate.lm_eval.engine_url == "http://127.0.0.1:9"
    cfg = load_config(None, [TASKS, SERVE, "evaluate.lm_eval.backend=engine", "evaluate.lm_eval.engine_url=http://127.0.0.1:10/"])
    assert cfg.evaluate.lm_eval.engine_url == "http://127.0.0.1:10"
    cfg = load_config(None, [TASKS, "evaluate.lm_eval.include_path=rel/tasks", "evaluate.lm_eval.limit=8"])
    assert cfg.evaluate.lm_eval.include_path == str(Path("rel/tasks").resolve())  # the evaluator runs elsewhere
    assert build_spec(cfg.evaluate.lm_eval)["limit"] == 8 and isinstance(build_spec(cfg.evaluate.lm_eval)["limit"], int)


def test_the_hook_runs_the_bundled_evaluator_with_its_spec_on_the_command_line(tmp_path):
    cfg = load_config(None, [TASKS, SERVE, "evaluate.lm_eval.backend=engine", "evaluate.lm_eval.engine_wait_s=12"])
    argv = build_argv(cfg.evaluate, ["/env/python"], tmp_path / "hf-step-000004", 4, tmp_path / "o.json",
                      "hf-step-000004", "KEY_VAR")
    assert argv[:5] == ["/env/python", "-m", MODULE, "run", str(tmp_path / "hf-step-000004")]
    assert argv[5:7] == ["--output", str(tmp_path / "o.json")] and argv[7] == "--spec"
    assert json.loads(argv[8]) == {
        "tasks": ["pfc_choice", "pfc_generate"], "include_path": str(bundled_tasks()), "builtin_tasks": False,
        "num_fewshot": None, "limit": None, "batch_size": 1, "backend": "engine", "log_samples": False,
        "name": "hf-step-000004", "engine": {"url": "http://127.0.0.1:9", "api_key_env": "KEY_VAR", "wait_s": 12.0}}
    assert describe_evaluator(cfg.evaluate) == "lm-eval (pfc_choice, pfc_generate; backend engine)"
    # the bundled pair ships with its data (package data: pyproject.toml)
    assert sorted(p.name for p in bundled_tasks().iterdir()) == [
        "pfc_choice.jsonl", "pfc_choice.yaml", "pfc_generate.jsonl", "pfc_generate.yaml"]
    assert all(len(p.read_text().splitlines()) >= 16 for p in bundled_tasks().glob("*.jsonl"))


def test_metrics_are_named_by_task_and_metric_with_the_filter_where_a_task_has_several():
    results = {  # lm-eval 0.4.13's results object, as simple_evaluate returns it
        "pfc_choice": {"name": "pfc_choice", "alias": "pfc_choice", "sample_len": 24, "acc,none": 0.25,
                       "acc_stderr,none": 0.09, "acc_norm,none": 0.4166, "acc_norm_stderr,none": 0.1},
        "pfc_generate": {"alias": "pfc_generate", "exact_match,strict-match": 0.125, "exact_match_stderr,strict-match":
                         0.08, "exact_match,first-word": 0.25, "exact_match_stderr,first-word": "N/A"},
        "solo": {"bleu,only-filter": 3.5}}
    assert metric_scores(results) == {
        "lm_eval.pfc_choice.acc": 0.25, "lm_eval.pfc_choice.acc_stderr": 0.09, "lm_eval.pfc_choice.acc_norm": 0.4166,
        "lm_eval.pfc_choice.acc_norm_stderr": 0.1, "lm_eval.pfc_generate.exact_match,strict-match": 0.125,
        "lm_eval.pfc_generate.exact_match_stderr,strict-match": 0.08, "lm_eval.pfc_generate.exact_match,first-word": 0.25,
        "lm_eval.solo.bleu": 3.5}


def _status(code=0):
    return {"exit_code": code, "seconds": 3.0, "finished_unix": 1.0, "last_line": ""}


def test_a_discarded_result_is_recorded_as_such_without_a_score_and_a_failure_in_its_own_words(tmp_path):
    running = {"snapshot": "hf-step-000002", "step": 2, "status": "running"}
    out = tmp_path / "output.json"
    why = "the engine http://e moved from hf-step-000002 to hf-step-000004 during the evaluation"
    out.write_text(json.dumps({"discarded": why, "backend": "engine", "engine": {"url": "http://e"}}))
    record = final_record(running, _status(0), out, "log tail")
    assert record["status"] == records.DISCARDED == "discarded" and record["error"] == f"discarded: {why}"
    assert "scores" not in record and records.scores_of(record) == {} and record["log_tail"] == "log tail"
    out.write_text(json.dumps({"error": "the engine stopped answering during the evaluation (refused)"}))
    record = final_record(running, _status(1), out)
    assert record["status"] == "failed" and record["error"] == (
        "exit status 1: the engine stopped answering during the evaluation (refused)")
    out.write_text("not json")
    assert final_record(running, _status(1), out)["error"] == "exit status 1"


def test_best_follows_an_lm_eval_metric_whose_name_holds_a_filter(tmp_path):
    from _snapshots import make_snapshot

    out = tmp_path / "out"
    out.mkdir()
    key = "lm_eval.pfc_generate.exact_match,strict-match"
    for step, value in ((2, 0.25), (4, 0.5), (6, 0.375)):
        records.write_record(make_snapshot(out, step), {"status": "ok", "scores": {key: value, "lm_eval.x.acc": 1 - value}})
    records.write_record(make_snapshot(out, 8), {"status": "discarded", "error": "discarded: ...", "result": {key: 1.0}})
    entries = {e.step: e.metrics for e in list_snapshots(out, PATTERN)}
    assert entries[4]["evaluate." + key] == 0.5 and entries[8] == {}  # a discarded result is never a score
    assert update_best(out, PATTERN, "evaluate." + key, "max", "run-a") == "hf-step-000004"
    assert update_best(out, PATTERN, "evaluate.lm_eval.x.acc", "max", "run-a") == "hf-step-000002"


def test_the_evaluator_reads_the_serve_record_by_its_name():
    assert eng.SERVE_RECORD == serve_records.RECORD


@pytest.fixture()
def engine():
    e = FakeVLLM()
    yield e
    e.stop()


def _serve_record(snap: Path, url: str, entry: dict) -> None:
    snap.mkdir(parents=True, exist_ok=True)
    (snap / eng.SERVE_RECORD).write_text(json.dumps({"serve_version": 1, "engines": {url: entry}}))


def test_an_evaluation_waits_for_its_snapshot_to_be_served_or_says_why_it_never_will(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(eng, "POLL_S", 0.01)
    client = eng.Engine(engine.url)
    snap = tmp_path / "hf-step-000002"
    engine.version = "hf-step-000002"
    assert eng.wait_served(client, "hf-step-000002", snap, 5) is None
    engine.version = "hf-step-000000"
    assert "did not serve hf-step-000002 within evaluate.lm_eval.engine_wait_s=0 s (it serves hf-step-000000; serve " \
           "record: none yet)" in eng.wait_served(client, "hf-step-000002", snap, 0)
    _serve_record(snap, engine.url, {"status": "skipped"})
    assert eng.wait_served(client, "hf-step-000002", snap, 60) == (
        f"the engine {engine.url} never served hf-step-000002: serving skipped it (a newer snapshot was served instead); "
        "it serves hf-step-000000")
    _serve_record(snap, engine.url, {"status": "ok", "version": "hf-step-000002"})
    engine.version = "hf-step-000004"
    assert "served hf-step-000002 and moved on to hf-step-000004" in eng.wait_served(client, "hf-step-000002", snap, 60)
    # serving is behind: the evaluation waits until the swap names the weights after its snapshot
    _serve_record(snap, engine.url, {"status": "running"})
    engine.version = "hf-step-000000"
    t0 = time.monotonic()
    import threading
    threading.Timer(0.3, lambda: setattr(engine, "version", "hf-step-000002")).start()
    assert eng.wait_served(client, "hf-step-000002", snap, 60) is None and time.monotonic() - t0 >= 0.3
    engine.stop()
    with pytest.raises(eng.EngineDown):
        eng.wait_served(client, "hf-step-000002", snap, 60)


def test_a_watch_sees_an_engine_that_moved_on_and_one_that_stopped_answering(engine, monkeypatch):
    monkeypatch.setattr(eng, "POLL_S", 0.01)
    client = eng.Engine(engine.url)
    engine.version = "hf-step-000002"
    watch = eng.Watch(client, "hf-step-000002")
    time.sleep(0.05)
    assert watch.finish() is None and not watch.moved and watch.down is None
    watch = eng.Watch(client, "hf-step-000002")
    engine.version = "hf-step-000004"  # swapped mid-run, then (as a fallback would) back again
    deadline = time.monotonic() + 10
    while len(watch.seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.version = "hf-step-000002"
    why = watch.finish()
    assert watch.moved and why.startswith(f"the engine {engine.url} moved from hf-step-000002 to hf-step-000004 during "
                                          "the evaluation (versions seen: hf-step-000002, hf-step-000004, hf-step-000002)")
    watch = eng.Watch(client, "hf-step-000002")
    engine.dead = True  # answers nothing any more
    why = watch.finish()
    assert not watch.moved and watch.down and why.startswith(f"the engine {engine.url} could not be asked what it served")


def _tasks_copy(tmp_path) -> Path:
    folder = tmp_path / "tasks"
    shutil.copytree(bundled_tasks(), folder)
    return folder


def test_the_start_proves_the_harness_the_tasks_and_their_data_in_the_evaluation_environment(hf_python, tmp_path):
    folder = _tasks_copy(tmp_path)
    cfg = LmEvalConfig(tasks=["pfc_choice", "pfc_generate"], include_path=str(folder), backend="engine")
    answer = check_lm_eval(cfg, [hf_python])
    assert answer["lm_eval"] == "0.4.13" and answer["tasks"] == {t: str(folder / f"{t}.yaml") for t in cfg.tasks}
    with pytest.raises(ConfigError, match=rf"^evaluate.lm_eval.tasks: task 'pfc_nope' is not in the task folder "
                                          rf"{folder} \(it has: pfc_choice, pfc_generate\); the harness's own tasks "
                                          r"need evaluate.lm_eval.builtin_tasks=true$"):
        check_lm_eval(LmEvalConfig(tasks=["pfc_choice", "pfc_nope"], include_path=str(folder), backend="engine"),
                      [hf_python])
    (folder / "pfc_generate.jsonl").unlink()
    with pytest.raises(ConfigError, match=rf"^evaluate.lm_eval.tasks: task 'pfc_generate' reads {folder}/pfc_generate"
                                          rf".jsonl, which does not exist \(dataset_kwargs.data_files in "
                                          rf"{folder}/pfc_generate.yaml\)$"):
        check_lm_eval(cfg, [hf_python])
    with pytest.raises(ConfigError, match=r"^evaluate.lm_eval.include_path: .*/gone is not a folder"):
        check_lm_eval(LmEvalConfig(tasks=["pfc_choice"], include_path=str(tmp_path / "gone")), [hf_python])


def test_an_environment_without_the_harness_is_refused_at_start(tmp_path):
    cfg = LmEvalConfig(tasks=["pfc_choice"], backend="engine")
    with pytest.raises(ConfigError, match=r"^evaluate.python: lm-eval cannot be imported there \(ModuleNotFoundError: "
                                          r"No module named 'lm_eval'\); pip install 'lm-eval\[hf,api\]==0.4.13'"):
        check_lm_eval(cfg, [sys.executable])  # the training environment: no lm-eval there
    assert not (tmp_path / RESULTS).exists()
