"""``paddle-fullparam convert`` on PaddleNLP 2.8.1 checkpoints written by the real Trainer.

Each topology the Trainer can save here (one process; dp2 with tied embeddings; mp2 with fused
q/k/v and gate/up; pp2 with ``LlamaForCausalLMPipe``) saves ``checkpoint-2`` as per-rank
``model_state[.tpXX][_ppYY].pdparams`` while the callback exports step 2, and the same weights are
also written by PaddleNLP's ``save_unified_checkpoint`` (merged safetensors). Both layouts, converted
from the files alone with the checkpoint's own config.json, are the callback's snapshot bit for
bit; a tensor-parallel checkpoint is merged by the model class's own merge rules, read as slices.
Damaged or incomplete checkpoints give one error naming the cause; nothing is written.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from _convert_cases import CHECKPOINT, SNAPSHOT, UNIFIED, assert_same_snapshot, run_job
from _helpers import run_hf_client
from paddle_fullparam_callbacks import verify_snapshot
from paddle_fullparam_callbacks.convert.checkpoints import CheckpointError
from paddle_fullparam_callbacks.convert.convert import convert

pytestmark = pytest.mark.paddlenlp

FW = "paddlenlp"
MODES = {"single": (), "dp2": ("--tied",), "mp2": ("--fused",), "pp2": ()}
CASES = [(m, CHECKPOINT) for m in MODES] + [(m, UNIFIED) for m in MODES if m != "dp2"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pnlp_convert_jobs")
    for mode, flags in MODES.items():
        run_job(FW, mode, root / mode, *flags)
    return root


@pytest.mark.parametrize("mode,layout", CASES, ids=[f"{m}-{'unified' if d == UNIFIED else 'pdparams'}" for m, d in CASES])
def test_a_paddlenlp_checkpoint_converts_to_the_callbacks_snapshot(jobs, mode, layout, tmp_path):
    base = jobs / mode
    info = convert(base / layout, tmp_path / "out", overrides=["export.max_shard_size=100KB"])
    assert verify_snapshot(info.path).ok
    assert_same_snapshot(info.path, base / SNAPSHOT)
    source = json.loads((info.path / "fullparam_manifest.json").read_text())["model"]["converted_from"]
    assert source["layout"] == ("unified-safetensors" if layout == UNIFIED else "pdparams")
    if layout == CHECKPOINT and mode in ("mp2", "pp2"):
        assert source["parallel"] == {"mp2": {"tensor_parallel_degree": 2}, "pp2": {"pipeline_parallel_degree": 2}}[mode]


def test_transformers_reads_a_converted_paddlenlp_snapshot_with_paddles_logits(jobs, tmp_path, hf_python):
    base = jobs / "single"
    info = convert(base / CHECKPOINT, tmp_path / "out")
    hf = run_hf_client(hf_python, info.path, np.load(base / "ids.npy"), np.load(base / "logits.npy"), tmp_path)
    assert hf["missing_keys"] == [] and hf["unexpected_keys"] == [] and hf["mismatched_keys"] == [], hf
    assert hf["max_abs_diff"] <= 1e-4, hf


def _drop(name):
    def damage(ckpt):
        (ckpt / name).unlink()
    return damage


def _truncate(name):
    def damage(ckpt):
        f = ckpt / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size - 1000])
    return damage


def _index_names_a_missing_shard(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model-00009-of-00009.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))


def _other_degree(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tensor_parallel_degree"] = 4
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "training_args.bin").unlink()


DAMAGE = {
    "a missing tensor-parallel rank file": ("mp2", CHECKPOINT, _drop("model_state.tp01.pdparams"),
                                            r"model_state\.tp01\.pdparams missing: the job had tensor_parallel_degree 2"),
    "a missing pipeline stage file": ("pp2", CHECKPOINT, _drop("model_state.pp01.pdparams"),
                                      r"model_state\.pp01\.pdparams missing"),
    "a truncated rank file": ("mp2", CHECKPOINT, _truncate("model_state.tp00.pdparams"), r"model_state\.tp00\.pdparams: "),
    "files for another degree": ("mp2", CHECKPOINT, _other_degree, r"tensor_parallel_degree 4"),
    "a truncated unified shard": ("mp2", UNIFIED, _truncate("model-00001-of-00002.safetensors"),
                                  r"model-00001-of-00002\.safetensors: .*(truncated|does not fit)"),
    "an index naming a missing shard": ("pp2", UNIFIED, _index_names_a_missing_shard,
                                        r"model-00009-of-00009\.safetensors (is missing|.*not a model)"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_paddlenlp_checkpoint_is_refused_before_anything_is_written(jobs, tmp_path, case):
    mode, layout, damage, message = DAMAGE[case]
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(jobs / mode / layout, ckpt)
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        convert(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
