"""The callback inside a real PaddleFormers Trainer run (single process, real training steps)."""
from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]

from paddle_fullparam_callbacks import ConfigError, FullParamExportCallback, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args  # noqa: E402

from _helpers import listing, run_cli  # noqa: E402


def test_snapshots_at_configured_steps_verify_and_retention(tmp_path):
    out = tmp_path / "snaps"
    cb = FullParamExportCallback(
        "hf_every_n_steps", overrides=[f"output_dir={out}", "trigger.every_n_steps=4", "trigger.on_save=true",
                                        "retention.keep_last=2", "export.max_shard_size=200KB"],
    )
    model = make_tiny_llama(seed=0)
    args = trainer_args("paddleformers", str(tmp_path / "trainer"), 12, save_steps=6)
    make_trainer("paddleformers", model, args, [cb]).train()
    # every_n_steps at 4, 8, 12; on_save at 6 and 12 (12 once: two triggers, one snapshot)
    assert cb.events == ["every_n_steps@4", "save@6", "every_n_steps@8", "every_n_steps@12"]
    assert [s.step for s in cb.snapshots] == [4, 6, 8, 12] and cb.errors == []
    kept = listing(out)
    assert kept == ["hf-step-000008", "hf-step-000012", "latest"]
    assert (out / "latest").read_text().strip() == "hf-step-000012"
    for name in kept[:2]:
        report = verify_snapshot(out / name)
        assert report.ok, report.errors
        manifest = json.loads((out / name / "fullparam_manifest.json").read_text())
        assert manifest["step"] == int(name[-6:]) and manifest["dtype"] == "bfloat16"
        assert manifest["versions"]["paddleformers"] == "1.2.0"
    # the snapshot of the last step holds the trained weights, not the initial ones
    from _helpers import snapshot_tensors

    final = snapshot_tensors(out / "hf-step-000012")["model.norm.weight"]
    import numpy as np
    import paddle

    expect = paddle.cast(model.state_dict()["model.norm.weight"], "bfloat16").view(paddle.uint16).numpy()
    assert np.array_equal(final, expect) and not np.all(final == final.flat[0])


def test_bad_recipe_fails_at_construction(tmp_path):
    with pytest.raises(ConfigError, match=r"trigger.every_n_steps: must be a whole number >= 1"):
        FullParamExportCallback(None, overrides=["trigger.every_n_steps=-5"])


def test_cli_demo_verify_and_recipes(tmp_path):
    demo = run_cli("demo", "--output-dir", str(tmp_path / "demo"), "--steps", "20", "trigger.every_n_steps=10")
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "hf-step-000020" in demo.stdout and "ok" in demo.stdout
    snaps = tmp_path / "demo" / "snapshots"
    good = snaps / "hf-step-000020"
    v = run_cli("verify", str(good), "--json")
    report = json.loads(v.stdout)
    assert v.returncode == 0 and report["ok"] and report["tensors"] == 21 and report["errors"] == []
    assert report["files"] >= 3 and report["bytes"] > 400_000
    # damage one byte of a shard: verify names the file and exits 1
    shard = sorted(good.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    v = run_cli("verify", str(good), "--json")
    report = json.loads(v.stdout)
    assert v.returncode == 1 and not report["ok"]
    assert any(shard.name in e and "blake3 differs from the manifest" in e for e in report["errors"])
    r = run_cli("recipes")
    assert r.returncode == 0 and "demo_tiny_llama" in r.stdout and "hf_every_n_steps" in r.stdout
