"""PaddleFormers 1.2 LoRA models: merged snapshots, PEFT adapters, tensor parallelism, convert.

Every case has a nonzero ``lora_B`` (zero at init would make every check pass). One module fixture
builds the cases, one launch runs mp2 (``tests/multirank/lora_tp_job.py``), one process of the hf
environment checks every snapshot with transformers and peft (``tests/hf_client/check_lora.py``):

* ``train``: the real Trainer on a ``LoRAModel`` (q/k/v/o + gate/up/down, r=4, alpha=8) with the
  callback (the issue's symptom: it stopped at ``on_train_begin``); its flex checkpoint of the same
  step, converted with the run's ``lora_config.json``, is the callback's snapshot bit for bit;
* ``ernie``: Ernie 4.5's fused q/k/v and up/gate (one LoRA layer over each fused weight), rslora with
  r=3, alpha=5 (an inexact scaling): the adapter splits and regroups ``lora_B`` as the weight is;
* ``merged``: layers merged by ``LoRAModel.merge()``: the update is not added twice;
* ``bf16``: bfloat16 weights with float32 adapters, merged in float32 and cast once (as peft does with
  a float32 adapter on a bfloat16 model: bit for bit);
* ``mp2``: column- and row-parallel LoRA layers on 2 ranks: the snapshot and its adapter equal the
  one-process export of the same values, bit for bit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.paddleformers

import paddle  # noqa: E402

from _helpers import ROOT, run_cli, snapshot_tensors  # noqa: E402
from _lora_cases import (  # noqa: E402
    ADAPTER, assert_hf_report, assert_same_snapshots, export, hf_case, logits, run_checks, set_nonzero_lora,
)
from paddle_fullparam_callbacks import FullParamExportCallback, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import TINY_LLAMA, make_tiny_llama, make_trainer, trainer_args  # noqa: E402
from paddle_fullparam_callbacks.convert.checkpoints import CheckpointError  # noqa: E402
from paddle_fullparam_callbacks.convert.convert import convert  # noqa: E402
from paddle_fullparam_callbacks.models.lora import LoraError  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "multirank"))
import harness  # noqa: E402
import lora_tp_job  # noqa: E402

ALL = [r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"]


def _lora(base, targets=ALL, **kw):
    from paddleformers.peft import LoRAConfig, LoRAModel

    return LoRAModel(base, LoRAConfig(target_modules=targets, **{"r": 4, "lora_alpha": 8, **kw}))


def _train(root: Path):
    """The real Trainer, 2 steps, the callback exporting step 2 with the adapter; checkpoint-2 saved."""
    lm = _lora(make_tiny_llama(seed=3, tie_word_embeddings=False))
    set_nonzero_lora(lm, seed=1)
    cb = FullParamExportCallback(None, overrides=[f"output_dir={root / 'snaps'}", "trigger.every_n_steps=2",
                                                  "trigger.on_train_end=false", "export.peft_adapter=inside",
                                                  "on_error=raise", "export.max_shard_size=100KB"])
    trainer = make_trainer("paddleformers", lm, trainer_args("paddleformers", str(root / "trainer"), 2, save_steps=2), [cb])
    trainer.train()
    assert cb.events == ["every_n_steps@2"] and not cb.errors, (cb.events, cb.errors)
    lm.lora_config.save_pretrained(str(root / "lora"))  # what PaddleFormers' flex checkpoint lacks
    (root / "model_config.json").write_text(json.dumps(dict(TINY_LLAMA, fuse_rms_norm=False, tie_word_embeddings=False,
                                                            architectures=["LlamaForCausalLM"])))
    return lm, cb.snapshots[0].path


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    root = tmp_path_factory.mktemp("pf_lora")
    out, hf = {}, []
    lm, snap = _train(root / "train")
    base = export(lm, root / "train" / "base", "export.lora=base").path
    out["train"] = dict(lm=lm, snapshot=snap, base=base)
    hf.append(hf_case(root / "hf", "train", snap, logits(lm), base))

    paddle.seed(1)
    ernie = _lora(Ernie4_5ForCausalLM(Ernie4_5Config(**dict(TINY_LLAMA, fuse_rms_norm=False), head_dim=16)),
                  [r".*\.(qkv|o)_proj", r".*\.(up_gate|down)_proj"], r=3, lora_alpha=5, rslora=True)
    set_nonzero_lora(ernie, seed=2)
    snap = export(ernie, root / "ernie", "export.peft_adapter=inside").path
    hf.append(hf_case(root / "hf", "ernie", snap, logits(ernie), export(ernie, root / "ernie-base", "export.lora=base").path))
    out["ernie"] = dict(lm=ernie, snapshot=snap)

    merged = _lora(make_tiny_llama(seed=4, tie_word_embeddings=False), [r".*\.(q|k|v|o)_proj"])
    set_nonzero_lora(merged, seed=3)
    unmerged_logits = logits(merged)
    merged.merge()
    out["merged"] = dict(lm=merged, snapshot=export(merged, root / "merged").path, unmerged_logits=unmerged_logits)
    hf.append(hf_case(root / "hf", "merged", out["merged"]["snapshot"], logits(merged)))

    bf = make_tiny_llama(seed=5, tie_word_embeddings=False)
    bf.to(dtype="bfloat16")
    bf16 = _lora(bf)
    set_nonzero_lora(bf16, seed=4)
    snap = export(bf16, root / "bf16", "export.peft_adapter=inside").path
    base = export(bf16, root / "bf16-base", "export.lora=base").path
    out["bf16"] = dict(lm=bf16, snapshot=snap, base=base)
    hf.append(hf_case(root / "hf", "bf16", snap, None, base, dtype="bfloat16"))

    out["mp2"] = _mp2(root / "mp2")
    hf.append(hf_case(root / "hf", "mp2", out["mp2"]["snapshot"], out["mp2"]["logits"], out["mp2"]["base"]))
    out["root"], out["hf_cases"] = root, hf
    return out


def _mp2(root: Path) -> dict:
    res = harness.run_launch(ROOT / "tests" / "multirank" / "lora_tp_job.py",
                             ["--framework", "paddleformers", "--variants", "unfused", "--out", root], nproc=2,
                             log_dir=root / "log", timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("LORA_TP")]
    assert len(reports) == 2 and all(not r.get("error") and not r["errors"] for r in reports), reports
    assert {"ColumnParallelLoRALinear", "RowParallelLoRALinear"} <= set(reports[0]["classes"]), reports[0]
    lm, base = lora_tp_job.build("paddleformers", "unfused")  # the same model and values on one process
    lora_tp_job.set_values(base)
    return dict(snapshot=Path(reports[0]["snapshots"][0]), logits=logits(lm),
                single=export(lm, root / "single", "export.peft_adapter=inside").path,
                base=export(lm, root / "single-base", "export.lora=base").path)


@pytest.fixture(scope="module")
def hf_reports(cases, hf_python):
    return run_checks(hf_python, cases["hf_cases"], cases["root"])


@pytest.mark.parametrize("name", ["train", "ernie", "mp2"])
def test_merged_snapshot_loads_in_transformers_and_equals_peft_merge_of_its_adapter(cases, hf_reports, name):
    r = hf_reports[name]
    assert_hf_report(r)
    assert verify_snapshot(cases[name]["snapshot"]).ok
    manifest = json.loads((cases[name]["snapshot"] / "fullparam_manifest.json").read_text())
    assert manifest["model"]["lora"]["export"] == "merged" and manifest["model"]["lora"]["states"]
    assert set(manifest["model"]["companions"][ADAPTER]) == {"adapter_model.safetensors", "adapter_config.json"}


def test_the_trainer_run_records_its_lora_and_the_adapter_config(cases):
    snap = cases["train"]["snapshot"]
    lora = json.loads((snap / "fullparam_manifest.json").read_text())["model"]["lora"]
    assert lora == {"export": "merged", "framework": "paddleformers", "layers": 14, "r": 4, "lora_alpha": 8,
                    "scaling": 2.0, "rslora": False, "target_modules": ALL,
                    "targets": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                    "states": {"active": 14}}
    cfg = json.loads((snap / ADAPTER / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == ("LORA", 4, 8, False)
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert not list(snap.glob("adapter_*"))  # not at the top: transformers would load the adapter instead


def test_fused_adapter_regroups_lora_b_like_the_weight(cases, hf_reports):
    snap = cases["ernie"]["snapshot"]
    cfg = json.loads((snap / ADAPTER / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (3, 5, True)
    adapter = snapshot_tensors(snap / ADAPTER)
    a = "base_model.model.model.layers.0.self_attn.{}_proj.lora_A.weight"
    assert np.array_equal(adapter[a.format("q")], adapter[a.format("k")])  # one A for the fused weight
    assert hf_reports["ernie"]["peft_modules"] == 14  # q, k, v, o, gate, up, down: HF's separate modules


def test_a_merged_layer_is_not_merged_twice(cases, hf_reports):
    assert_hf_report(hf_reports["merged"], peft=False)
    assert np.abs(logits(cases["merged"]["lm"]) - cases["merged"]["unmerged_logits"]).max() < 1e-4
    lora = json.loads((cases["merged"]["snapshot"] / "fullparam_manifest.json").read_text())["model"]["lora"]
    assert lora["states"] == {"merged": 8}


def test_bf16_weights_merge_in_float32_and_cast_once(cases, hf_reports):
    from paddle_fullparam_callbacks.models.lora.merge import as_float32
    from paddle_fullparam_callbacks.models.lora.product import exact_product

    lm = cases["bf16"]["lm"]
    layer = lm.model.model.layers[0].self_attn.q_proj
    w = layer.weight.view(paddle.uint16).numpy()
    a, b = layer.lora_A.numpy(), layer.lora_B.numpy()
    f32 = as_float32(w, "bfloat16") + (exact_product(b.T, a.T) * np.float32(layer.scaling)).T  # the product's rule
    want = paddle.to_tensor(f32).astype("bfloat16").view(paddle.uint16).numpy().T
    got = snapshot_tensors(cases["bf16"]["snapshot"])["model.layers.0.self_attn.q_proj.weight"]
    assert got.dtype == np.uint16 and np.array_equal(got, want)
    # float32 adapters: peft adds the float32 update to the bfloat16 weight in float32 and rounds once, too
    assert_hf_report(hf_reports["bf16"])


def test_mp2_snapshot_and_adapter_equal_the_one_process_export(cases):
    assert_same_snapshots(cases["mp2"]["snapshot"], cases["mp2"]["single"])


def test_flex_checkpoint_converts_to_the_callbacks_snapshot(cases, tmp_path):
    root = cases["train"]["snapshot"].parents[1]
    ckpt = root / "trainer" / "checkpoint-2"
    info = convert(ckpt, tmp_path / "out", model_config=root / "model_config.json", lora_config=root / "lora",
                   overrides=["export.peft_adapter=inside", "export.max_shard_size=100KB"])
    assert info.step == 2 and verify_snapshot(info.path).ok
    assert_same_snapshots(info.path, cases["train"]["snapshot"])
    assert (info.path / "config.json").read_text() == (cases["train"]["snapshot"] / "config.json").read_text()
    with pytest.raises(CheckpointError, match="no lora_config.json, and the run's lora_alpha and rslora"):
        convert(ckpt, tmp_path / "none", model_config=root / "model_config.json")
    assert not (tmp_path / "none").exists()


def test_the_base_an_engine_serving_adapters_starts_on_converts_from_the_flex_checkpoint(cases, tmp_path):
    """``convert --as-base`` (docs/serving.md: the base the engine starts on): the LoRA run's checkpoint gives its base
    weights without the update, the callback's ``export.lora=base`` snapshot bit for bit, and no adapter."""
    root = cases["train"]["snapshot"].parents[1]
    out = run_cli("convert", str(root / "trainer" / "checkpoint-2"), "--output-dir", str(tmp_path / "base"),
                  "--as-base", "--config", str(root / "model_config.json"), "--lora-config", str(root / "lora"))
    assert out.returncode == 0, out.stderr
    path = tmp_path / "base" / "hf-step-000002"
    assert f"the base for serve.adapter: start the engine on {path}" in out.stdout and verify_snapshot(path).ok
    assert_same_snapshots(path, cases["train"]["base"], adapter=False) and not (path / ADAPTER).exists()


def test_refusals_name_the_cause(cases, tmp_path):
    with pytest.raises(LoraError, match="export.lora=base: LoRA layer .* is merged into its weight"):
        export(cases["merged"]["lm"], tmp_path / "a", "export.lora=base")

    from paddleformers.peft.lora.lora_layers import LoRAConv2D

    lm = _lora(make_tiny_llama(seed=6), [r".*\.q_proj"])
    lm.model.model.extra = LoRAConv2D(2, 2, 1, r=1)
    with pytest.raises(LoraError, match="LoRA layer 'model.extra' is a .*LoRAConv2D: the exporter merges"):
        export(lm, tmp_path / "b")
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").glob("hf-*"))


def test_the_base_model_with_lora_layers_exports_as_its_wrapper(cases, tmp_path):
    # the second symptom: the inner model was refused ("lora_A ... under Paddle names no statement maps")
    inner = export(cases["ernie"]["lm"].model, tmp_path / "inner", "export.peft_adapter=inside").path
    assert_same_snapshots(inner, cases["ernie"]["snapshot"])


def test_a_lora_snapshot_has_the_same_bytes_whatever_the_blas_threading(tmp_path):
    """Issue 30: the same LoRA models exported by processes whose OpenBLAS runs 1 or 2 threads (and the machine's
    default), products of 1024 x 16 x 2816 (large enough for OpenBLAS to thread them): the same bytes. Issue 42:
    and the bytes recorded before the product's computation changed (every value of the three models is set from
    numpy's seeded generator: the same inputs on every machine; tests/unit/data/lora_snapshot_golden.json)."""
    import os
    import subprocess

    reports = {}
    for setting in ("1", "2", None):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
        if setting:
            env["OPENBLAS_NUM_THREADS"] = setting
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_lora_blas_job.py"), str(tmp_path / f"t{setting}")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        if setting:
            assert report["blas_threads"] in (int(setting), None), report  # None: no OpenBLAS found to ask
        reports[setting] = report
    golden = json.loads((ROOT / "tests" / "unit" / "data" / "lora_snapshot_golden.json").read_text())
    for setting, report in reports.items():
        differ = sorted(k for k in set(golden) | set(report["digests"]) if golden.get(k) != report["digests"].get(k))
        assert not differ, (setting, differ)
    for case, snap in reports["1"]["snapshots"].items():
        assert_same_snapshots(Path(snap), Path(reports["2"]["snapshots"][case]))
        assert_same_snapshots(Path(snap), Path(reports[None]["snapshots"][case]))
