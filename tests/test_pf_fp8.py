"""FP8 snapshots (``export.quantization=fp8``) of a model trained by the real Trainer, as the clients read them.

- The trained Llama's FP8 snapshot (bfloat16, blocks of 32 x 32) is the rule (``tests/_fp8_reference.py``)
  applied to the bfloat16 snapshot the same training exports without quantization, bit for bit;
  transformers 5.24 loads it as written (on a CPU it dequantizes) with logits equal to those of the
  bfloat16 snapshot whose quantized weights are replaced by their dequantized values, and within the FP8
  error of the bfloat16 snapshot's own; ``verify --transformers`` accepts it; llama.cpp's
  ``convert_hf_to_gguf.py`` writes a GGUF whose every tensor is the dequantized weight, bit for bit.
- A Llama whose dimensions are not multiples of the block (hidden 192, intermediate 400, default blocks of
  128 x 128): partial edge blocks, one warning at start naming transformers' defect; llama.cpp reads it
  right; transformers 5.24 still misreads it (the defect recorded here; this test says when it is fixed).
- What is refused before the first step: an architecture without a declaration, through the Trainer.
"""
from __future__ import annotations

import json
import logging
import subprocess

import numpy as np
import pytest

pytestmark = [pytest.mark.paddleformers, pytest.mark.hf_client]

from paddle_fullparam_callbacks import FullParamExportCallback  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import (  # noqa: E402
    DEMO_TOKENIZER, demo_tokenizer, make_tiny_llama, make_trainer, trainer_args, TokenDataset,
)
from paddle_fullparam_callbacks.config import ConfigError, load_config  # noqa: E402
from paddle_fullparam_callbacks.export import ExportSession, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.models.model_info import build_model_source  # noqa: E402
from paddle_fullparam_callbacks.plan.quantization import MISREAD  # noqa: E402

from _fp8_reference import quantize, widen_bf16  # noqa: E402
from _helpers import ROOT, snapshot_tensors  # noqa: E402

BLOCK = [32, 32]
FP8 = ["export.dtype=bfloat16", "export.quantization=fp8"]


def _ids(vocab: int = 512) -> np.ndarray:
    return np.random.default_rng(5).integers(0, vocab, (2, 16))


def _check_rule(fp8, plain, block) -> list:
    """The FP8 snapshot is the rule on the plain (bfloat16) one; returns the quantized names."""
    got, want = snapshot_tensors(fp8), snapshot_tensors(plain)
    quantized = sorted(k for k in got if k + "_scale_inv" in got)
    assert set(got) == set(want) | {k + "_scale_inv" for k in quantized}
    for k, v in want.items():
        if k in quantized:
            q, inv = quantize(widen_bf16(v), block)
            assert got[k].tobytes() == q.tobytes() and got[k + "_scale_inv"].tobytes() == inv.tobytes(), k
        else:
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
    return quantized


def _hf(hf_python, fp8, plain, tmp_path) -> dict:
    np.save(tmp_path / "ids.npy", _ids())
    proc = subprocess.run([hf_python, str(ROOT / "tests" / "hf_client" / "check_fp8.py"), str(fp8), str(plain),
                           str(tmp_path / "ids.npy")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gguf(hf_python, converter, snapshot, tmp_path) -> dict:
    data = ROOT / "paddle_fullparam_callbacks" / "cli" / "demo_data"
    proc = subprocess.run([hf_python, str(ROOT / "tests" / "hf_client" / "convert_gguf.py"), converter, str(snapshot),
                           str(tmp_path / "out.gguf"), str(data / "heldout.txt")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["returncode"] == 0 and "Model successfully exported" in r["output"], r["output"][-3000:]
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained 4 steps by the Trainer, with two callbacks: bfloat16, and bfloat16 + FP8."""
    root = tmp_path_factory.mktemp("fp8")
    plain = FullParamExportCallback(None, overrides=[f"output_dir={root / 'bf16'}", "export.dtype=bfloat16",
                                                     "on_error=raise"])
    fp8 = FullParamExportCallback(None, overrides=[f"output_dir={root / 'fp8'}", *FP8, f"export.quantization_block={BLOCK}",
                                                   "export.max_shard_size=100KB", "on_error=raise"])
    args = trainer_args("paddleformers", str(root / "trainer"), 4, save_steps=1000)
    make_trainer("paddleformers", make_tiny_llama(seed=9, tie_word_embeddings=False), args, [plain, fp8],
                 train_dataset=TokenDataset(n=32), tokenizer=demo_tokenizer()).train()
    assert plain.errors == fp8.errors == [] and plain.snapshots and fp8.snapshots
    return {"root": root, "plain": plain.snapshots[-1].path, "fp8": fp8.snapshots[-1].path}


def test_the_trained_models_fp8_snapshot_is_the_rule_on_its_bfloat16_snapshot(trained):
    fp8 = trained["fp8"]
    assert verify_snapshot(fp8).ok
    quantized = _check_rule(fp8, trained["plain"], BLOCK)
    assert len(quantized) == 14 and not any("embed" in k or "lm_head" in k or "norm" in k for k in quantized)
    config = json.loads((fp8 / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK,
        "modules_to_not_convert": ["lm_head"]}
    notes = json.loads((fp8 / "fullparam_manifest.json").read_text())["model"]["quantization"]
    assert notes == {"method": "fp8", "weight_block_size": BLOCK, "weights": 14, "modules_to_not_convert": 1,
                     "misread_by_transformers": []}
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(index[k + "_scale_inv"] == index[k] for k in quantized)  # each scale in its weight's file
    fp8_bytes = sum(f.stat().st_size for f in fp8.glob("*.safetensors"))
    plain_bytes = sum(f.stat().st_size for f in trained["plain"].glob("*.safetensors"))
    assert fp8_bytes < plain_bytes


def test_transformers_loads_it_with_the_dequantized_weights_logits(trained, hf_python, tmp_path):
    r = _hf(hf_python, trained["fp8"], trained["plain"], tmp_path)
    assert r["class"] == "LlamaForCausalLM" and r["quantized"] == 14, r
    assert r["missing_keys"] == r["unexpected_keys"] == r["mismatched_keys"] == [], r
    assert r["dequantized_logits_diff"] == 0.0, r  # exactly the dequantized weights' function
    assert r["weights_compared"] == 14 and r["weights_misread"] == {}, r
    # within the FP8 error of the bfloat16 snapshot's logits (e4m3 keeps 3 mantissa bits: ~3% per weight)
    assert 0 < r["plain_logits_diff"] <= 0.1 * r["logits_absmax"], r
    proc = subprocess.run([hf_python, "-m", "paddle_fullparam_callbacks", "verify", "--transformers", "--json",
                           str(trained["fp8"])], capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"] and report["transformers"]["ok"], report


def test_llama_cpps_converter_dequantizes_it_to_the_same_tensors(trained, hf_python, llama_cpp_converter, tmp_path):
    r = _gguf(hf_python, llama_cpp_converter, trained["fp8"], tmp_path)
    assert r["tensors"] == 21 and r["gguf_only"] == r["snapshot_only"] == r["unequal"] == [], r


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A Llama of dimensions that are not multiples of 128 (hidden 192, intermediate 400), default blocks."""
    root = tmp_path_factory.mktemp("fp8_odd")
    import paddle

    model = make_tiny_llama(seed=11, tie_word_embeddings=False, hidden_size=192, intermediate_size=400,
                            num_attention_heads=6, num_key_value_heads=6)
    rng = np.random.default_rng(11)
    with paddle.no_grad():  # blocks of different magnitudes (an initialised model's are all alike): scales differ
        for _, p in model.named_parameters():
            if len(p.shape) == 2:
                rows, cols = p.shape
                ramp = np.linspace(0.5, 4.0, rows)[:, None] * np.linspace(1.0, 3.0, cols)[None, :]
                p.set_value(paddle.to_tensor((rng.standard_normal((rows, cols)) * 0.02 * ramp).astype("float32")))
    out = {}
    for name, extra in (("plain", ["export.dtype=bfloat16"]), ("fp8", FP8)):
        cfg = load_config(None, [f"output_dir={root / name}", f"export.tokenizer={DEMO_TOKENIZER}", *extra])
        session = ExportSession(cfg, cfg.output_dir)
        session.start()
        log = logging.getLogger("paddle_fullparam_callbacks")
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        log.addHandler(handler)
        try:
            out[name] = session.export(build_model_source(model, cfg), 1).path
        finally:
            log.removeHandler(handler)
            session.close()
        out[f"{name}_warnings"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    return out


def test_partial_edge_blocks_and_one_warning_naming_transformers_defect(odd):
    warned = [w for w in odd["fp8_warnings"] if "transformers 5.x dequantizes such a weight wrongly" in w]
    assert len(warned) == 1 and MISREAD in warned[0] and "14 weight(s)" in warned[0], odd["fp8_warnings"]
    assert not any("dequantizes" in w for w in odd["plain_warnings"])
    assert verify_snapshot(odd["fp8"]).ok
    quantized = _check_rule(odd["fp8"], odd["plain"], (128, 128))
    got = snapshot_tensors(odd["fp8"])
    assert got["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (4, 2)  # [400, 192]: 3 x 128 + 16, 128 + 64
    assert len(quantized) == 14


def test_llama_cpp_reads_partial_blocks_right_and_transformers_does_not(odd, hf_python, llama_cpp_converter, tmp_path):
    r = _gguf(hf_python, llama_cpp_converter, odd["fp8"], tmp_path)
    assert r["tensors"] == 21 and r["gguf_only"] == r["snapshot_only"] == r["unequal"] == [], r
    t = _hf(hf_python, odd["fp8"], odd["plain"], tmp_path)
    assert t["weights_compared"] == 14 and t["missing_keys"] == t["unexpected_keys"] == [], t
    # transformers 5.24's defect (plan/quantization.MISREAD): it cuts each of these weights into blocks of
    # rows // scale rows (192 // 2 = 96, 400 // 4 = 100), not 128: every one comes back with other values
    assert "load_error" not in t, t
    assert len(t["weights_misread"]) == 14 and t["dequantized_logits_diff"] > 0, t


def test_an_architecture_without_a_declaration_is_refused_before_the_first_step(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "zoo"))
    from case import all_cases
    from run_zoo import build

    case = next(c for c in all_cases("paddleformers") if c.id == "pf-gpt_oss")
    _, model = build(case)
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 'snaps'}", *FP8])
    trainer = make_trainer("paddleformers", model, trainer_args("paddleformers", str(tmp_path / "t"), 2, save_steps=1000),
                           [cb], train_dataset=TokenDataset(n=8))
    with pytest.raises(ConfigError, match="fp8 is not available for GptOssForCausalLM") as e:
        trainer.train()
    assert e.value.key == "export.quantization"
    assert trainer.state.global_step == 0 and cb.snapshots == []
    assert not (tmp_path / "snaps").exists() or not any(p.name.startswith("hf-step") for p in (tmp_path / "snaps").iterdir())
    with pytest.raises(ConfigError, match="export.quantization_block: must be two positive whole numbers"):
        FullParamExportCallback(None, overrides=["export.quantization=fp8", "export.quantization_block=[128]"])
