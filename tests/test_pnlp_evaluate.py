"""The evaluation hook with the real PaddleNLP Trainer: each snapshot scored by a fake evaluator in a
separate process, the scores through ``trainer.log``, ``best`` following them (the PaddleFormers
side, failures and crashes are in tests/test_pf_evaluate.py)."""
from __future__ import annotations

import sys

import pytest

from paddle_fullparam_callbacks import attach, verify_snapshot
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.export.commit import evaluation as records

from _evaluators import Recorder, calls, fake_evaluator, stop_leftovers
from _helpers import listing

pytestmark = [pytest.mark.paddlenlp, pytest.mark.slow]


def test_paddlenlp_trainer_snapshots_are_scored_and_best_follows(tmp_path):
    command = fake_evaluator(tmp_path, {"scores": {"2": 3.0, "4": 1.0, "6": 2.0}})
    logged = Recorder()
    trainer = make_trainer("paddlenlp", make_tiny_llama("paddlenlp", seed=0),
                           trainer_args("paddlenlp", str(tmp_path / "trainer"), 6, save_steps=100), [logged])
    cb = attach(trainer, None, overrides=[
        f"output_dir={tmp_path / 'snaps'}", "trigger.every_n_steps=2", f"evaluate.command={command}",
        f"evaluate.python={sys.executable}", "retention.metric=evaluate.score", "retention.keep_best=1",
        "retention.keep_last=1"])
    try:
        trainer.train()
    finally:
        stop_leftovers(tmp_path)
    assert [(ev.step, ev.status, ev.scores["score"]) for ev in cb.evaluation.results] == [
        (2, "ok", 3.0), (4, "ok", 1.0), (6, "ok", 2.0)]
    assert sorted(c["step"] for c in calls(tmp_path)) == [2, 4, 6]
    assert [(e["fullparam/eval/snapshot_step"], e["fullparam/eval/score"]) for e in logged.logs] == [
        (2.0, 3.0), (4.0, 1.0), (6.0, 2.0)]
    snaps = tmp_path / "snaps"
    assert listing(snaps) == ["best", "hf-step-000004", "hf-step-000006", "latest"]
    assert (snaps / "best").read_text().strip() == "hf-step-000004"
    assert records.read_record(snaps / "hf-step-000004")["scores"]["score"] == 1.0
    assert verify_snapshot(snaps / "hf-step-000004").ok


def test_paddlenlp_trainer_snapshots_are_served_through_the_checkpoint_hook_too(tmp_path):
    """Serving with the PaddleNLP Trainer (the vLLM stand-in; the real server is tests/test_pf_serve.py's): each
    snapshot, the checkpoint hook's included, reaches the engine under its name; the engine's model directory is
    a snapshot of the same model, so the start's fit check runs against it."""
    from _engine import FakeVLLM

    from paddle_fullparam_callbacks.consumers.serve import records as serve_records

    base = tmp_path / "base"
    trainer = make_trainer("paddlenlp", make_tiny_llama("paddlenlp", seed=0),
                           trainer_args("paddlenlp", str(tmp_path / "trainer0"), 1, save_steps=100), [])
    attach(trainer, None, overrides=[f"output_dir={base}", "trigger.on_train_end=true"])
    trainer.train()
    engine = FakeVLLM(root=str(base / "hf-step-000001"))
    try:
        trainer = make_trainer("paddlenlp", make_tiny_llama("paddlenlp", seed=1),
                               trainer_args("paddlenlp", str(tmp_path / "trainer"), 4, save_steps=2), [])
        cb = attach(trainer, None, overrides=[
            f"output_dir={tmp_path / 'snaps'}", "checkpoint_hook.enabled=true", f"serve.url={engine.url}",
            "serve.wait=true", "trigger.on_train_end=false"])
        trainer.train()
    finally:
        engine.stop()
    assert [(j.name, j.record["status"]) for j in cb.serving.results] == [("checkpoint-2/hf", "ok"), ("checkpoint-4/hf", "ok")]
    assert engine.state()["version"] == "checkpoint-4/hf" and engine.state()["weights"] == str(
        (tmp_path / "trainer" / "checkpoint-4" / "hf").resolve())
    assert serve_records.read(tmp_path / "trainer" / "checkpoint-4" / "hf", engine.url)["status"] == "ok"
