"""PaddleNLP 2.8 LoRA models: merged snapshots, PEFT adapters, tensor parallelism, convert.

Every case has a nonzero ``lora_B``. One module fixture builds the cases, one launch runs mp2 for the
unfused and the fused layouts (``tests/multirank/lora_tp_job.py``), one process of the hf environment
checks every snapshot with transformers and peft (``tests/hf_client/check_lora.py``):

* ``train``: the real Trainer on a ``LoRAModel`` with the callback; its checkpoint
  (``lora_model_state.pdparams``, no base weights) converted with ``--base`` (the base model saved
  before training) is the callback's snapshot of the same step, bit for bit;
* ``fused``: ``fuse_attention_qkv`` / ``fuse_attention_ffn`` (q/k/v grouped per key-value head), rslora
  with r=3, alpha=5: the adapter's ``lora_B`` split and regrouped as the weight is;
* ``merge_weights``: ``model.eval()`` merged every layer into its weight: not added twice;
* ``pissa``: after the first forward the weight is the residual base; the snapshot is what the model
  computes, and the adapter (which would apply to that residual) is refused;
* ``mp2``, ``mp2-fused``: the callback on 2 ranks equals the one-process export of the same values;
* ``pp2``: the same on two pipeline stages (``LlamaForCausalLMPipe`` in ``LoRAModel``): each stage
  merges its own layers; the coordinator's adapter holds the other stage's layers too.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.paddlenlp

import paddle  # noqa: E402

from _helpers import ROOT, snapshot_tensors  # noqa: E402
from _lora_cases import (  # noqa: E402
    ADAPTER, assert_hf_report, assert_same_snapshots, export, hf_case, logits, run_checks, set_nonzero_lora,
)
from paddle_fullparam_callbacks import FullParamExportCallback, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args  # noqa: E402
from paddle_fullparam_callbacks.convert.convert import convert  # noqa: E402
from paddle_fullparam_callbacks.convert.prepare import ConvertError  # noqa: E402
from paddle_fullparam_callbacks.models.lora import LoraError  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "multirank"))
import harness  # noqa: E402
import lora_tp_job  # noqa: E402

ALL = [r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"]
FUSED = [r".*\.(qkv|o)_proj", r".*\.(gate_up_fused|down)_proj"]


def _lora(base, targets=ALL, **kw):
    from paddlenlp.peft import LoRAConfig, LoRAModel

    return LoRAModel(base, LoRAConfig(target_modules=targets, **{"r": 4, "lora_alpha": 8, **kw}))


def _train(root: Path):
    base = make_tiny_llama("paddlenlp", seed=3, tie_word_embeddings=False)
    base.save_pretrained(str(root / "base_model"))  # the base the run starts from (--base)
    lm = _lora(base)
    set_nonzero_lora(lm, seed=1)
    cb = FullParamExportCallback(None, overrides=[f"output_dir={root / 'snaps'}", "trigger.every_n_steps=2",
                                                  "trigger.on_train_end=false", "export.peft_adapter=inside",
                                                  "on_error=raise"])
    trainer = make_trainer("paddlenlp", lm, trainer_args("paddlenlp", str(root / "trainer"), 2, save_steps=2), [cb])
    trainer.train()
    assert cb.events == ["every_n_steps@2"] and not cb.errors, (cb.events, cb.errors)
    return lm, cb.snapshots[0].path


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("pnlp_lora")
    out, hf = {}, []
    lm, snap = _train(root / "train")
    base = export(lm, root / "train-base", "export.lora=base").path
    out["train"] = dict(lm=lm, snapshot=snap, root=root / "train")
    hf.append(hf_case(root / "hf", "train", snap, logits(lm), base))

    fused = _lora(make_tiny_llama("paddlenlp", seed=4, fuse_attention_qkv=True, fuse_attention_ffn=True,
                                  tie_word_embeddings=False), FUSED, r=3, lora_alpha=5, rslora=True)
    set_nonzero_lora(fused, seed=2)
    snap = export(fused, root / "fused", "export.peft_adapter=inside").path
    hf.append(hf_case(root / "hf", "fused", snap, logits(fused), export(fused, root / "fused-base", "export.lora=base").path))
    out["fused"] = dict(lm=fused, snapshot=snap)

    mw = _lora(make_tiny_llama("paddlenlp", seed=5), merge_weights=True)
    set_nonzero_lora(mw, seed=3)
    mw.eval()  # PaddleNLP merges every layer into its weight here
    out["merge_weights"] = dict(lm=mw, snapshot=export(mw, root / "mw").path)
    hf.append(hf_case(root / "hf", "merge_weights", out["merge_weights"]["snapshot"], logits(mw)))

    pissa = _lora(make_tiny_llama("paddlenlp", seed=6), pissa=True)
    pending = export(pissa, root / "pissa-pending").path  # before the first forward: W as it is
    pissa.train()
    with paddle.no_grad():
        pissa(paddle.to_tensor(np.array([[1, 2, 3]])))  # the first forward: W := W - A0 @ B0
    set_nonzero_lora(pissa, seed=4)  # as training moves B away from B0
    out["pissa"] = dict(lm=pissa, snapshot=export(pissa, root / "pissa").path, pending=pending)
    hf.append(hf_case(root / "hf", "pissa", out["pissa"]["snapshot"], logits(pissa)))

    for variant in ("unfused", "fused"):
        out[f"mp2-{variant}"] = _mp2(root / "mp2", variant)
        hf.append(hf_case(root / "hf", f"mp2-{variant}", out[f"mp2-{variant}"]["snapshot"],
                          out[f"mp2-{variant}"]["logits"], out[f"mp2-{variant}"]["base"]))
    out["pp2"] = _mp2(root / "pp2", "unfused", pp=2)
    hf.append(hf_case(root / "hf", "pp2", out["pp2"]["snapshot"], out["pp2"]["logits"], out["pp2"]["base"]))
    out["root"], out["hf_cases"] = root, hf
    return out


def _mp2(root: Path, variant: str, pp: int = 1) -> dict:
    """mp2 (both variants, one launch), or with ``pp=2`` two pipeline stages (``LlamaForCausalLMPipe``)."""
    if not (root / "log").exists():
        variants = "unfused,fused" if pp == 1 else "unfused"
        res = harness.run_launch(ROOT / "tests" / "multirank" / "lora_tp_job.py",
                                 ["--framework", "paddlenlp", "--variants", variants, "--out", root, "--pp", pp],
                                 nproc=2, log_dir=root / "log", timeout=300)
        assert res.rc == 0 and not res.timed_out, res.describe()
        reports = [r for _, r in res.tagged("LORA_TP")]
        assert len(reports) == 2 * len(variants.split(",")), reports
        assert all(not r.get("error") and not r["errors"] for r in reports), reports
    lm, base = lora_tp_job.build("paddlenlp", variant)  # the same model and values on one process
    lora_tp_job.set_values(base)
    return dict(snapshot=root / (variant + ("-pp2" if pp > 1 else "")) / "hf-step-000001", logits=logits(lm),
                single=export(lm, root / f"single-{variant}", "export.peft_adapter=inside").path,
                base=export(lm, root / f"base-{variant}", "export.lora=base").path)


@pytest.fixture(scope="module")
def hf_reports(cases, hf_python):
    return run_checks(hf_python, cases["hf_cases"], cases["root"])


@pytest.mark.parametrize("name", ["train", "fused", "mp2-unfused", "mp2-fused", "pp2"])
def test_merged_snapshot_loads_in_transformers_and_equals_peft_merge_of_its_adapter(cases, hf_reports, name):
    assert_hf_report(hf_reports[name])
    assert verify_snapshot(cases[name]["snapshot"]).ok


def test_fused_qkv_adapter_is_regrouped_per_key_value_head(cases, hf_reports):
    snap = cases["fused"]["snapshot"]
    cfg = json.loads((snap / ADAPTER / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (3, 5, True)
    layer = cases["fused"]["lm"].model.llama.layers[0].self_attn.qkv_proj
    b = layer.lora_B.numpy()  # [r, (groups + 2) * head_dim * kv] grouped per key-value head
    adapter = snapshot_tensors(snap / ADAPTER)
    q = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    k = adapter["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    kv, head = 2, 16  # tiny Llama: 4 heads, 2 key-value heads, head_dim 16
    per = b.shape[1] // kv
    assert np.array_equal(k[:head], b[:, per - 2 * head:per - head].T)  # group 0's k head
    assert np.array_equal(q[:head], b[:, :head].T) and not np.array_equal(q, b[:, :q.shape[0]].T)
    assert hf_reports["fused"]["peft_modules"] == 14


def test_merge_weights_layers_are_not_merged_twice(cases, hf_reports):
    assert_hf_report(hf_reports["merge_weights"], peft=False)
    lora = json.loads((cases["merge_weights"]["snapshot"] / "fullparam_manifest.json").read_text())["model"]["lora"]
    assert lora["states"] == {"merged": 14}


def test_pissa_exports_what_the_model_computes_and_refuses_its_adapter(cases, hf_reports, tmp_path):
    assert_hf_report(hf_reports["pissa"], peft=False)
    lora = json.loads((cases["pissa"]["snapshot"] / "fullparam_manifest.json").read_text())["model"]["lora"]
    assert (lora["pissa"], lora["scaling"], lora["states"]) == (True, 1.0, {"active": 14})
    pending = json.loads((cases["pissa"]["pending"] / "fullparam_manifest.json").read_text())["model"]["lora"]
    assert pending["states"] == {"pissa_pending": 14}
    with pytest.raises(LoraError, match="PiSSA layers .* their adapter applies to the residual base"):
        export(cases["pissa"]["lm"], tmp_path / "x", "export.peft_adapter=inside")


@pytest.mark.parametrize("case", ["mp2-unfused", "mp2-fused", "pp2"])
def test_parallel_snapshot_and_adapter_equal_the_one_process_export(cases, case):
    assert_same_snapshots(cases[case]["snapshot"], cases[case]["single"])


def test_lora_checkpoint_converts_with_its_base_to_the_callbacks_snapshot(cases, tmp_path):
    root = cases["train"]["root"]
    ckpt = root / "trainer" / "checkpoint-2"
    assert (ckpt / "lora_model_state.pdparams").is_file() and not list(ckpt.glob("model_state*"))
    info = convert(ckpt, tmp_path / "out", base=root / "base_model", overrides=["export.peft_adapter=inside"])
    assert info.step == 2 and verify_snapshot(info.path).ok
    assert_same_snapshots(info.path, cases["train"]["snapshot"])
    assert (info.path / "config.json").read_text() == (cases["train"]["snapshot"] / "config.json").read_text()
    with pytest.raises(ConvertError, match="holds LoRA tensors only .* give the base model .* --base PATH"):
        convert(ckpt, tmp_path / "none")
    assert not (tmp_path / "none").exists()
