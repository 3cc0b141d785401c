"""Training integration with the real PaddleFormers Trainer: evaluation, best-by-metric,
the checkpoint hook and its rotation, resume, background writes, recipes."""
from __future__ import annotations

import json
import os

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach, verify_snapshot
from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_tiny_llama, make_trainer, trainer_args

from _helpers import listing

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]


class ScriptedMetric:
    """Placed before the exporter: rewrites each evaluation's metrics (the dict is shared by all
    callbacks) so that the best-by-metric logic sees a known sequence."""

    def __init__(self, name, values):
        self.name, self.values, self.seen = name, list(values), []

    def __getattr__(self, attr):
        if attr.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(attr)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics[self.name] = self.values[len(self.seen)]
        self.seen.append((state.global_step, metrics[self.name]))


def _eval_args(tmp_path, steps, **kw):
    return trainer_args("paddleformers", str(tmp_path / "trainer"), steps, evaluation_strategy="steps",
                        eval_steps=2, per_device_eval_batch_size=4, save_steps=100, **kw)


def test_best_by_metric_keeps_the_right_snapshots(tmp_path):
    out = tmp_path / "snaps"
    script = ScriptedMetric("eval_score", [0.1, 0.5, 0.3, 0.9, 0.2])
    cb = FullParamExportCallback.from_recipe(
        "eval_best", overrides=[f"output_dir={out}", "retention.metric=eval_score", "retention.mode=max"])
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), _eval_args(tmp_path, 10), [script, cb],
                           eval_dataset=TokenDataset(n=8, seed=1))
    trainer.train()
    assert [s for s, _ in script.seen] == [2, 4, 6, 8, 10]
    assert cb.events == ["evaluate@2", "evaluate@4", "evaluate@6", "evaluate@8", "evaluate@10"]
    # keep_best=2 (0.9 at step 8, 0.5 at step 4) + keep_last=1 (step 10)
    kept = listing(out)
    assert kept == ["best", "hf-step-000004", "hf-step-000008", "hf-step-000010", "latest"]
    assert (out / "best").read_text().strip() == "hf-step-000008"
    assert (out / "latest").read_text().strip() == "hf-step-000010"
    m = json.loads((out / "hf-step-000008" / "fullparam_manifest.json").read_text())
    assert m["metrics"]["eval_score"] == 0.9 and "eval_loss" in m["metrics"] and m["reason"] == "evaluate"
    for name in kept:
        if name.startswith("hf-"):
            assert verify_snapshot(out / name).ok


def test_metric_of_a_step_exported_earlier_is_attached_to_its_snapshot(tmp_path):
    # every_n_steps fires on_step_end *before* the evaluation of the same step: the snapshot must
    # still be ranked by that evaluation's metric
    out = tmp_path / "snaps"
    script = ScriptedMetric("eval_score", [3.0, 1.0, 2.0])
    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={out}", "trigger.every_n_steps=2", "trigger.on_save=false", "trigger.on_train_end=false",
        "retention.metric=eval_score", "retention.keep_best=1", "retention.keep_last=1"])
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), _eval_args(tmp_path, 6), [script, cb],
                           eval_dataset=TokenDataset(n=8, seed=1))
    trainer.train()
    assert cb.events == ["every_n_steps@2", "every_n_steps@4", "every_n_steps@6"]
    assert listing(out) == ["best", "hf-step-000004", "hf-step-000006", "latest"]
    assert (out / "best").read_text().strip() == "hf-step-000004"


def test_missing_metric_is_a_clear_error(tmp_path):
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 's'}", "retention.metric=eval_nope"])
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), _eval_args(tmp_path, 4), [cb],
                           eval_dataset=TokenDataset(n=8, seed=1))
    with pytest.raises(ValueError, match=r"retention.metric 'eval_nope' is not in the evaluation results; they have: .*eval_loss"):
        trainer.train()


# PaddleFormers 1.2.0 cannot resume a single-process job from its default flex_checkpoint format:
# Trainer._load_flex_checkpoint calls fleet.get_hybrid_communicate_group() without fleet.init
# ("'Fleet' object has no attribute '_hcg'"), with or without this package; unified_checkpoint resumes.
CKPT_FORMAT = dict(save_checkpoint_format="unified_checkpoint", load_checkpoint_format="unified_checkpoint")


def test_checkpoint_hook_layout_rotation_and_resume(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    args = trainer_args("paddleformers", str(tmp_path / "trainer"), 6, save_steps=2, save_total_limit=2, **CKPT_FORMAT)
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), args, [])
    cb = attach(trainer, "checkpoint_hook")
    trainer.train()
    run = tmp_path / "trainer"
    ckpts = sorted(p for p in os.listdir(run) if p.startswith("checkpoint-"))
    assert ckpts == ["checkpoint-4", "checkpoint-6"]  # rotation removed checkpoint-2 with its snapshot
    for c in ckpts:
        report = verify_snapshot(run / c / "hf")
        assert report.ok, report.errors
        assert json.loads((run / c / "hf" / "fullparam_manifest.json").read_text())["step"] == int(c.split("-")[1])
        assert not [p for p in os.listdir(run / c) if p.startswith(".tmp-")]
    assert cb.events == ["checkpoint@2", "checkpoint@4", "checkpoint@6"]
    # no separate on_save snapshot next to the checkpoints
    assert not (run / "fullparam").exists()  # nor an empty snapshot directory left behind
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("snapshot ")]
    assert [line.split(" (")[0] for line in lines] == [f"snapshot checkpoint-{n}/hf" for n in (2, 4, 6)]
    # resuming from a checkpoint that holds a snapshot keeps working
    args2 = trainer_args("paddleformers", str(run), 8, save_steps=2, save_total_limit=2, **CKPT_FORMAT)
    trainer2 = make_trainer("paddleformers", make_tiny_llama(seed=0), args2, [])
    attach(trainer2, "checkpoint_hook")
    trainer2.train(resume_from_checkpoint=str(run / "checkpoint-6"))
    assert verify_snapshot(run / "checkpoint-8" / "hf").ok


class LogRecorder(ScriptedMetric):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_async_writes_verify_and_stall_less_than_the_write(tmp_path):
    out = tmp_path / "snaps"
    model = make_tiny_llama(seed=0, hidden_size=256, intermediate_size=512, vocab_size=8192, num_hidden_layers=2)
    recorder = LogRecorder()
    trainer = make_trainer("paddleformers", model, trainer_args("paddleformers", str(tmp_path / "t"), 9, save_steps=100),
                           [recorder], train_dataset=TokenDataset(n=64, vocab=8192))
    cb = attach(trainer, "async_every_n_steps",
                overrides=[f"output_dir={out}", "trigger.every_n_steps=3", "export.max_pending_bytes=64MB"])
    trainer.train()
    assert cb.errors == []
    assert [s.step for s in cb.snapshots] == [3, 6, 9]
    assert all(not s.pending for s in cb.snapshots)  # each finished by the next event / train end
    for s in cb.snapshots:
        assert verify_snapshot(s.path).ok
        assert s.stall_s < s.seconds, (s.stall_s, s.seconds)  # training waited less than the export took
        manifest = json.loads((s.path / "fullparam_manifest.json").read_text())
        assert manifest["async_write"] is True and manifest["timings"]["stall_s"] == pytest.approx(s.stall_s, abs=1e-6)
    # the stall of each export went through trainer.log, like any training metric (VisualDL, W&B)
    stalls = [e["fullparam/stall_s"] for e in recorder.logs if "fullparam/stall_s" in e]
    assert stalls == [round(s.stall_s, 4) for s in cb.snapshots]
