"""``paddle-fullparam convert`` on PaddleFormers 1.2 flex checkpoints written by the real Trainer.

Each topology the Trainer can save here (one process; dp2 with tied embeddings; mp2; pp2 with
``LlamaForCausalLMPipe``) saves ``checkpoint-2`` while the callback exports step 2. The checkpoint,
converted from its files alone (no job, no ranks; the model's config.json given, as flex
checkpoints carry none), is the callback's snapshot bit for bit; one-process logits in transformers
match Paddle's. Damaged, incomplete or mismatched checkpoints give one error naming the cause, and
the output directory is never created.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _convert_cases import CHECKPOINT, SNAPSHOT, assert_same_snapshot, run_job
from _helpers import run_hf_client
from paddle_fullparam_callbacks import verify_snapshot
from paddle_fullparam_callbacks.convert.checkpoints import CheckpointError
from paddle_fullparam_callbacks.convert.convert import convert

FW = "paddleformers"
# case -> (job mode, flags)
MODES = {"single": ("single", ()), "bf16": ("single", ("--bf16",)), "dp2": ("dp2", ("--tied",)), "mp2": ("mp2", ()),
         "pp2": ("pp2", ())}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pf_convert_jobs")
    for case, (mode, flags) in MODES.items():
        run_job(FW, mode, root / case, *flags)
    return root


@pytest.mark.parametrize("mode", list(MODES))
def test_a_flex_checkpoint_converts_to_the_callbacks_snapshot(jobs, mode, tmp_path):
    base = jobs / mode
    info = convert(base / CHECKPOINT, tmp_path / "out", model_config=base / "model_config.json",
                   overrides=["export.max_shard_size=100KB"])
    assert info.path == tmp_path / "out" / "hf-step-000002" and info.step == 2
    assert verify_snapshot(info.path).ok
    assert_same_snapshot(info.path, base / SNAPSHOT)
    source = json.loads((info.path / "fullparam_manifest.json").read_text())["model"]["converted_from"]
    assert source["layout"] == "flex" and source["framework"] == FW
    assert source["parallel"] == {"single": {}, "bf16": {}, "dp2": {"data_parallel_degree": 2},
                                  "mp2": {"tensor_parallel_degree": 2}, "pp2": {"pipeline_parallel_degree": 2}}[mode]
    dtypes = {e["dtype"] for e in json.loads((info.path / "fullparam_manifest.json").read_text())["files"].values()
              if isinstance(e, dict) and "dtype" in e}
    assert json.loads((info.path / "config.json").read_text())["dtype"] == ("bfloat16" if mode == "bf16" else "float32"), dtypes
    assert (tmp_path / "out" / "latest").read_text().strip() == "hf-step-000002"


def test_a_float32_checkpoint_converts_to_bfloat16_as_paddle_casts(jobs, tmp_path):
    import paddle

    from _helpers import snapshot_tensors

    base = jobs / "single"
    info = convert(base / CHECKPOINT, tmp_path / "out", model_config=base / "model_config.json",
                   overrides=["export.dtype=bfloat16"])
    got, fp32 = snapshot_tensors(info.path), snapshot_tensors(base / SNAPSHOT)
    assert set(got) == set(fp32)
    for k, v in fp32.items():
        want = paddle.to_tensor(v).astype("bfloat16").view(paddle.uint16).numpy()
        assert got[k].dtype == np.uint16 and got[k].tobytes() == want.tobytes(), k
    assert json.loads((info.path / "config.json").read_text())["dtype"] == "bfloat16"


def test_transformers_reads_a_converted_snapshot_with_paddles_logits(jobs, tmp_path, hf_python):
    base = jobs / "single"
    info = convert(base / CHECKPOINT, tmp_path / "out", model_config=base / "model_config.json")
    hf = run_hf_client(hf_python, info.path, np.load(base / "ids.npy"), np.load(base / "logits.npy"), tmp_path)
    assert hf["missing_keys"] == [] and hf["unexpected_keys"] == [] and hf["mismatched_keys"] == [], hf
    assert hf["max_abs_diff"] <= 1e-4, hf


def test_the_cli_converts_to_fp8_with_several_workers(jobs, tmp_path):
    """``convert`` with ``export.quantization=fp8``: each worker quantizes the whole tensors of its files; every
    quantized weight and scale is the rule's (``tests/_fp8_reference.py``) on the bfloat16 snapshot's tensor."""
    import paddle

    from _fp8_reference import quantize, widen_bf16
    from _helpers import snapshot_tensors

    base = jobs / "mp2"
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_fullparam_callbacks", "convert", str(base / CHECKPOINT), "--output-dir", str(out),
         "--config", str(base / "model_config.json"), "--workers", "2", "export.max_shard_size=30KB",
         "export.dtype=bfloat16", "export.quantization=fp8", "export.quantization_block=[32,32]"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    snap = out / "hf-step-000002"
    assert verify_snapshot(snap).ok
    writers = json.loads((snap / "fullparam_manifest.json").read_text())["topology"]["writers"]
    assert sorted(writers) == ["0", "1"] and all(writers.values()), writers
    got, fp32 = snapshot_tensors(snap), snapshot_tensors(base / SNAPSHOT)
    quantized = sorted(k for k in got if k + "_scale_inv" in got)
    assert len(quantized) == 14 and set(got) == set(fp32) | {k + "_scale_inv" for k in quantized}
    for k, v in fp32.items():
        bf16 = paddle.to_tensor(v).astype("bfloat16").view(paddle.uint16).numpy()
        if k in quantized:
            q, inv = quantize(widen_bf16(bf16), (32, 32))
            assert got[k].tobytes() == q.tobytes() and got[k + "_scale_inv"].tobytes() == inv.tobytes(), k
        else:
            assert got[k].tobytes() == bf16.tobytes(), k
    assert json.loads((snap / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]


def test_the_cli_converts_with_several_workers(jobs, tmp_path):
    base = jobs / "dp2"
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "paddle_fullparam_callbacks", "convert", str(base / CHECKPOINT), "--output-dir", str(out),
         "--config", str(base / "model_config.json"), "--workers", "2", "export.max_shard_size=100KB"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{out / 'hf-step-000002'}  step 2  21 tensors  6 file(s)" in proc.stdout
    manifest = json.loads((out / "hf-step-000002" / "fullparam_manifest.json").read_text())
    writers = manifest["topology"]["writers"]
    assert sorted(writers) == ["0", "1"] and all(writers.values()), writers  # both workers wrote files
    assert sorted(p.name for p in out.iterdir()) == ["hf-step-000002", "latest"]  # no lock or progress files left
    assert_same_snapshot(out / "hf-step-000002", base / SNAPSHOT)


def _metadata(ckpt: Path) -> Path:
    return next((ckpt / "model_state").glob("*.metadata"))


def _drop_rank_file(ckpt):
    (ckpt / "model_state" / "1_0.distcp").unlink()


def _truncate(ckpt):
    f = ckpt / "model_state" / "0_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _foreign_metadata(ckpt, jobs=None):
    shutil.copy(_metadata(jobs / "mp2" / CHECKPOINT), _metadata(ckpt))  # another job's metadata over these files


def _not_a_pickle(ckpt):
    (ckpt / "model_state" / "1_0.distcp").write_bytes(np.random.default_rng(0).bytes(4096))


def _no_metadata(ckpt):
    _metadata(ckpt).unlink()


def _evil_metadata(ckpt):
    # a pickle that would run a command when loaded by pickle.load: refused, never run
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/pfc-pwned",))

    _metadata(ckpt).write_bytes(pickle.dumps(Evil(), protocol=4))


DAMAGE = {
    "a missing rank file": (_drop_rank_file, r"model_state/1_0\.distcp is missing"),
    "a truncated rank file": (_truncate, r"0_0\.distcp"),
    "metadata of another job": (_foreign_metadata, r"model_state/0_0\.distcp: tensor .* is float32 \[.*\], but model_state/0\.metadata says"),
    "a rank file that is not a pickle": (_not_a_pickle, r"model_state/1_0\.distcp: "),
    "no metadata": (_no_metadata, r"not a trainer checkpoint"),
    "a pickle that runs code": (_evil_metadata, r"0\.metadata: refusing global posix\.system"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_before_anything_is_written(jobs, tmp_path, case):
    damage, message = DAMAGE[case]
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(jobs / "dp2" / CHECKPOINT, ckpt)
    if damage is _foreign_metadata:
        damage(ckpt, jobs)
    else:
        damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        convert(ckpt, tmp_path / "out", model_config=jobs / "dp2" / "model_config.json")
    assert not (tmp_path / "out").exists()
    assert not Path("/tmp/pfc-pwned").exists()


def test_a_checkpoint_that_does_not_match_its_config_is_refused(jobs, tmp_path):
    config = json.loads((jobs / "single" / "model_config.json").read_text())
    wrong = tmp_path / "config.json"
    wrong.write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"9 parameter\(s\) of LlamaForCausalLM missing from the checkpoint.*"
                                              r"is the config the one this checkpoint was trained with"):
        convert(jobs / "single" / CHECKPOINT, tmp_path / "out", model_config=wrong)
    wrong.write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"another shape than the model's, e.g. '.*mlp.*': checkpoint \[.*128.*\], model"):
        convert(jobs / "single" / CHECKPOINT, tmp_path / "out", model_config=wrong)
    assert not (tmp_path / "out").exists()


def test_a_flex_checkpoint_without_a_config_asks_for_one(jobs, tmp_path):
    with pytest.raises(CheckpointError, match="holds no config.json .*give the model's config with --config"):
        convert(jobs / "single" / CHECKPOINT, tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "convert", str(jobs / "single" / CHECKPOINT),
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "give the model's config with --config" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_second_conversion_never_replaces_the_first(jobs, tmp_path):
    base = jobs / "single"
    first = convert(base / CHECKPOINT, tmp_path / "out", model_config=base / "model_config.json")
    before = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}
    from paddle_fullparam_callbacks.export.source import ExportError

    with pytest.raises(ExportError, match="hf-step-000002"):
        convert(base / CHECKPOINT, tmp_path / "out", model_config=base / "model_config.json")
    assert {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()} == before
    assert verify_snapshot(first.path).ok


def test_tokenizer_files_saved_in_the_checkpoint_are_copied_into_the_snapshot(jobs, tmp_path):
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(jobs / "single" / CHECKPOINT, ckpt)
    (ckpt / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (ckpt / "special_tokens_map.json").write_text('{"pad_token": "<pad>"}')
    (ckpt / "notes.txt").write_text("not a tokenizer file")
    info = convert(ckpt, tmp_path / "out", model_config=jobs / "single" / "model_config.json")
    names = {p.name for p in info.path.iterdir()}
    assert {"tokenizer_config.json", "special_tokens_map.json"} <= names and "notes.txt" not in names
    assert (info.path / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    assert "tokenizer_config.json" in json.loads((info.path / "fullparam_manifest.json").read_text())["files"]
    assert verify_snapshot(info.path).ok


_CONVERT_IN_A_PROCESS = """
import json, sys
from paddle_fullparam_callbacks.convert.convert import convert
info = convert(sys.argv[1], sys.argv[2], model_config=sys.argv[3], overrides=["export.max_shard_size=100KB"])
print(json.dumps({"path": str(info.path), "class_imported": "paddleformers.transformers.llama.modeling" in sys.modules}))
"""


def test_a_second_conversion_of_the_model_needs_no_model_class(jobs, tmp_path):
    """Issue 42: the first conversion keeps the model's description (convert/described.py); the next one of the same
    model reads it instead of importing the framework's model class, and writes the same snapshot (tensors, index,
    config.json, the manifest's model notes); a model config that differs is another description."""
    base = jobs / "single"
    env = dict(os.environ, PADDLE_FULLPARAM_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for i in range(2):
        proc = subprocess.run([sys.executable, "-c", _CONVERT_IN_A_PROCESS, str(base / CHECKPOINT), str(tmp_path / f"o{i}"),
                               str(base / "model_config.json")], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [r["class_imported"] for r in runs] == [True, False]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    first, second = (Path(r["path"]) for r in runs)
    assert_same_snapshot(second, base / SNAPSHOT)
    assert_same_snapshot(second, first)
    notes = [json.loads((p / "fullparam_manifest.json").read_text())["model"] for p in (first, second)]
    assert notes[0] == notes[1]
    other = json.loads((base / "model_config.json").read_text())
    other["num_hidden_layers"] += 1  # the checkpoint no longer matches: refused as before, by the class's model
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match="does not match the model its config describes"):
        convert(base / CHECKPOINT, tmp_path / "o3", model_config=tmp_path / "other.json")
