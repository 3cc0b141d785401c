"""The bundled lm-eval evaluator (issue 41) with the real PaddleFormers Trainer, the real harness (the ``hf``
environment) and one real vLLM server (its CPU build, started once for the module): a trained tiny model's snapshots
scored on the bundled task pair (multiple choice and generation) on the engine that serves them while training goes
on, then on transformers by ``paddle-fullparam evaluate``, with the same metrics, log-likelihoods and generations;
``best`` following an lm-eval metric; with training faster than scoring, the engine held on each snapshot until its
evaluation is over (every snapshot it serves scored as transformers scores it, no training step delayed); without
the hold, an engine that moved to a newer snapshot during a run (discarded, never the snapshot's score); an engine
that went down mid-evaluation; the start refused before step 1 for a missing task and a missing data file; the
harness's built-in tasks found only when asked for."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import demo_tokenizer, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.config.consumers import LmEvalConfig
from paddle_fullparam_callbacks.config.schema import ConfigError
from paddle_fullparam_callbacks.consumers.evaluate import check_lm_eval
from paddle_fullparam_callbacks.consumers.evaluate.lmeval.spec import RESULTS, bundled_tasks
from paddle_fullparam_callbacks.consumers.serve import records as serve_records
from paddle_fullparam_callbacks.export.commit import evaluation as records

from _engine import Proxy
from _evaluators import wait_until
from _helpers import AtStep, listing, run_cli
from _vllm import MODEL, VLLMServer, base_snapshot

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]
KEY, KEY_ENV = "pfc-lmeval-key", "PFC_TEST_LMEVAL_KEY"
TASKS = "evaluate.lm_eval.tasks=[pfc_choice,pfc_generate]"
METRIC = "evaluate.lm_eval.pfc_choice.acc_norm"


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One vLLM server on the base snapshot (seed 0), with an API key (the evaluator sends it)."""
    tmp = tmp_path_factory.mktemp("engine")
    s = VLLMServer(base_snapshot(tmp / "base"), tmp / "vllm.log", api_key=KEY)
    try:
        yield s.wait_ready()
    finally:
        s.kill()


@pytest.fixture()
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def train(tmp_path, hf_python, overrides, steps=4, at=None):
    """The tiny model trained ``steps`` steps, a snapshot every 2, each scored on the bundled pair (at the training's
    priority: the suite's other worker would leave a nice-10 evaluator little of the 2 cores)."""
    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={tmp_path / 'snaps'}", "trigger.every_n_steps=2", f"evaluate.python={hf_python}", TASKS,
        "evaluate.lm_eval.log_samples=true", "evaluate.timeout_s=600", "evaluate.nice=0", *overrides])
    targs = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, save_steps=1000)
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=1, **MODEL), targs, [], tokenizer=demo_tokenizer())
    attach(trainer, cb)
    if at:
        trainer.add_callback(AtStep(at))
    trainer.train()
    return cb


def engine_overrides(url):
    return [f"serve.url=[{url}]", f"serve.api_key_env={KEY_ENV}", "serve.wait=true", "evaluate.lm_eval.backend=engine",
            "evaluate.lm_eval.engine_wait_s=120"]


def finished(snap: Path):
    return lambda: (records.read_record(snap) or {}).get("status") not in (None, "running")


def samples(snap: Path) -> dict:
    return json.loads((snap / RESULTS).read_text())["samples"]


def test_snapshots_scored_on_the_engine_that_serves_them_and_on_transformers_agree(server, key, hf_python, tmp_path):
    snaps = tmp_path / "snaps"
    # each evaluation ends before the next snapshot is served (a job whose steps take longer than an evaluation)
    at = {3: lambda: wait_until(finished(snaps / name(2)), "the evaluation of step 2", 400)}
    cb = train(tmp_path, hf_python, [*engine_overrides(server.url), f"retention.metric={METRIC}", "retention.mode=max"],
               at=at)
    assert [(ev.name, ev.status) for ev in cb.evaluation.results] == [(name(2), "ok"), (name(4), "ok")]
    engine = {}
    for step in (2, 4):
        snap = snaps / name(step)
        record = records.read_record(snap)
        result = record["result"]
        assert result["backend"] == "engine" and result["engine"] == {"url": server.url, "version": name(step)}
        assert result["results_file"] == RESULTS and result["lm_eval_version"] == "0.4.13"
        assert record["command"].split()[1:4] == ["-m", "paddle_fullparam_callbacks.consumers.evaluate.lmeval", "run"]
        scores = {k: v for k, v in record["scores"].items() if k.startswith("lm_eval.")}
        assert set(scores) == {"lm_eval.pfc_choice.acc", "lm_eval.pfc_choice.acc_stderr", "lm_eval.pfc_choice.acc_norm",
                               "lm_eval.pfc_choice.acc_norm_stderr", "lm_eval.pfc_generate.exact_match,strict-match",
                               "lm_eval.pfc_generate.exact_match_stderr,strict-match",
                               "lm_eval.pfc_generate.exact_match,first-word",
                               "lm_eval.pfc_generate.exact_match_stderr,first-word"}
        raw = json.loads((snap / RESULTS).read_text())
        assert raw["results"]["pfc_choice"]["acc_norm,none"] == scores["lm_eval.pfc_choice.acc_norm"]
        assert len(raw["samples"]["pfc_choice"]) == 24 and len(raw["samples"]["pfc_generate"]) == 2 * 16  # per filter
        engine[step] = (scores, samples(snap))
    # best follows the lm-eval metric (the higher acc_norm; either of two equal ones)
    acc = {s: engine[s][0]["lm_eval.pfc_choice.acc_norm"] for s in (2, 4)}
    best = (snaps / "best").read_text().strip()
    assert acc[int(best[-6:])] == max(acc.values())
    assert not any(e.status != "ok" for e in cb.evaluation.results) and cb.errors == []

    # the same snapshots on transformers (the default backend), afterwards, as a user would
    out = run_cli("evaluate", str(snaps), "--all", f"evaluate.python={hf_python}", TASKS, "evaluate.nice=0",
                  "evaluate.lm_eval.log_samples=true", f"retention.metric={METRIC}", "retention.mode=max")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "evaluating 2 of 2 snapshot(s) with: lm-eval (pfc_choice, pfc_generate; backend hf)" in out.stdout
    for step in (2, 4):
        snap = snaps / name(step)
        record = records.read_record(snap)
        assert record["status"] == "ok" and record["result"]["backend"] == "hf"
        hf_scores = {k: v for k, v in record["scores"].items() if k.startswith("lm_eval.")}
        assert hf_scores == engine[step][0]  # the same metrics, exactly
        hf_samples, engine_samples = samples(snap), engine[step][1]
        for a, b in zip(hf_samples["pfc_choice"], engine_samples["pfc_choice"], strict=True):
            assert a["doc_id"] == b["doc_id"] and a["target"] == b["target"]
            for (ll_a, _), (ll_b, _) in zip([r[0] for r in a["resps"]], [r[0] for r in b["resps"]], strict=True):
                assert abs(ll_a - ll_b) <= 1e-4 * max(1.0, abs(ll_a)), (ll_a, ll_b)
        # greedy generations: the same text, decoded and cut as transformers' backend does
        assert [s["resps"] for s in hf_samples["pfc_generate"]] == [s["resps"] for s in engine_samples["pfc_generate"]]
    assert (snaps / "best").read_text().strip() == best and f"best -> {best}" in out.stdout


def test_with_the_hold_every_snapshot_the_engine_serves_is_scored_as_transformers_scores_it(server, key, hf_python,
                                                                                            tmp_path):
    """Training faster than scoring (8 steps in seconds, an evaluation in many): the engine stays on each snapshot
    until its evaluation is over, the swaps that queued meanwhile go newest first, and no step waits for either."""
    stepped = {}
    at = {s: (lambda s=s: stepped.setdefault(s, time.time())) for s in range(1, 9)}
    cb = train(tmp_path, hf_python, [f"serve.url=[{server.url}]", f"serve.api_key_env={KEY_ENV}",
                                     "evaluate.lm_eval.backend=engine", "evaluate.lm_eval.engine_wait_s=600"],
               steps=8, at=at)
    snaps = tmp_path / "snaps"
    served = {j.name for j in cb.serving.results if j.record["status"] == "ok"}
    skipped = {j.name for j in cb.serving.results if j.record["status"] == "skipped"}
    assert served == {name(2), name(8)} and skipped == {name(4), name(6)} and server.version() == name(8)
    by = {ev.name: ev for ev in cb.evaluation.results}
    assert {n: by[n].status for n in by} == {name(2): "ok", name(4): "discarded", name(6): "discarded", name(8): "ok"}
    assert "serving skipped it" in by[name(4)].record["error"]
    # the swap to step 8 waited for the evaluation of step 2; every training step was over long before that
    eval_2 = records.read_record(snaps / name(2))
    swap_8 = serve_records.read(snaps / name(8), server.url)
    assert swap_8["started_unix"] >= eval_2["finished_unix"] > stepped[8]
    scores = {n: {k: v for k, v in by[n].scores.items() if k.startswith("lm_eval.")} for n in served}
    out = run_cli("evaluate", str(snaps), "--all", f"evaluate.python={hf_python}", TASKS, "evaluate.nice=0")
    assert out.returncode == 0, out.stdout + out.stderr
    for n in served:  # every snapshot the engine served has transformers' score
        hf = records.read_record(snaps / n)
        assert hf["result"]["backend"] == "hf" and {k: v for k, v in hf["scores"].items()
                                                    if k.startswith("lm_eval.")} == scores[n]


def test_an_engine_that_moves_to_a_newer_snapshot_during_the_run_gives_no_score(server, key, hf_python, tmp_path):
    proxy = Proxy(server.url)  # holds the evaluator's first request until snapshot 4 is served
    arrived = proxy.hang(lambda m, p, b: p.startswith("/v1/completions"))
    try:  # engine_hold=false: today's freshness first, the swap does not wait for the evaluation
        cb = train(tmp_path, hf_python, [*engine_overrides(proxy.url), "evaluate.lm_eval.engine_hold=false"],
                   at={3: lambda: arrived.wait(400) or pytest.fail("no request of the evaluation of step 2 arrived"),
                       4: proxy.release})  # step 4's export returned: the engine serves hf-step-000004
    finally:
        proxy.stop()
    by = {ev.name: ev for ev in cb.evaluation.results}
    record = records.read_record(tmp_path / "snaps" / name(2))
    assert by[name(2)].status == record["status"] == "discarded" and "scores" not in record
    assert record["error"].startswith(f"discarded: the engine {proxy.url} moved from {name(2)} to {name(4)} during the "
                                      "evaluation")
    assert not (tmp_path / "snaps" / name(2) / RESULTS).exists()
    assert by[name(4)].status == "ok" and by[name(4)].scores["lm_eval.pfc_choice.acc"] >= 0  # the newest: scored
    assert server.version() == name(4)


def test_an_engine_down_mid_evaluation_fails_that_evaluation_and_never_training(server, key, hf_python, tmp_path):
    proxy = Proxy(server.url)
    arrived = proxy.hang(lambda m, p, b: p.startswith("/v1/completions"))

    def engine_dies():
        assert arrived.wait(400), "no request of the evaluation of step 2 arrived"
        proxy.stop()  # the held request is answered; nothing answers after it

    cb = train(tmp_path, hf_python, engine_overrides(proxy.url), at={3: engine_dies})
    snaps = tmp_path / "snaps"
    record = records.read_record(snaps / name(2))
    assert record["status"] == "failed" and record["error"].startswith(
        f"exit status 1: the engine stopped answering during the evaluation ({proxy.url}: GET /weight_info")
    assert "the harness said:" in record["error"] and "scores" not in record
    later = records.read_record(snaps / name(4))  # never served; its evaluation cannot reach the engine either
    assert later["status"] == "failed" and "the engine does not answer" in later["error"]
    assert cb.errors == [] and listing(snaps)[-1] == "latest" and (snaps / name(4)).is_dir()


def test_a_missing_task_or_data_file_stops_the_job_before_step_one(hf_python, tmp_path):
    folder = tmp_path / "tasks"
    shutil.copytree(bundled_tasks(), folder)
    with pytest.raises(ConfigError, match=r"^evaluate.lm_eval.tasks: task 'pfc_missing' is not in the task folder "):
        train(tmp_path / "a", hf_python, [f"evaluate.lm_eval.include_path={folder}",
                                          "evaluate.lm_eval.tasks=[pfc_choice,pfc_missing]"])
    (folder / "pfc_choice.jsonl").unlink()
    with pytest.raises(ConfigError, match=rf"^evaluate.lm_eval.tasks: task 'pfc_choice' reads {folder}/pfc_choice.jsonl, "
                                          r"which does not exist"):
        train(tmp_path / "b", hf_python, [f"evaluate.lm_eval.include_path={folder}"])
    assert not (tmp_path / "a" / "snaps").exists() and not (tmp_path / "b" / "snaps").exists()
    # the harness's own tasks only when asked for (their index is ~14,000 files)
    builtin = LmEvalConfig(tasks=["pfc_choice", "arc_easy"], builtin_tasks=True, backend="engine")
    found = check_lm_eval(builtin, [hf_python])["tasks"]
    assert Path(found["arc_easy"]).parts[-3:] == ("tasks", "arc", "arc_easy.yaml") and "lm_eval" in found["arc_easy"]
    with pytest.raises(ConfigError, match=r"task 'arc_easy' is not in the task folder .*builtin_tasks=true$"):
        check_lm_eval(LmEvalConfig(tasks=["arc_easy"], backend="engine"), [hf_python])
