"""``verify`` reads an FP8 weight's bytes: every block whose scale is finite, nonzero and not 1 holds a code of
magnitude 448 (``export/verify/fp8_blocks.py``, issue 46). Snapshots here are real (writer, index, manifest,
config.json), their bytes made by the independent reference of the rule, then damaged the ways a chunked loop or a
disk damages them, before they are hashed (so the checksums agree and only the invariant can tell)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.export import commit
from paddle_fullparam_callbacks.export.commit.manifest import describe_files
from paddle_fullparam_callbacks.export.verify import fp8_blocks
from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot
from paddle_fullparam_callbacks.export.write import checksum
from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _fp8_reference as ref  # noqa: E402

BLOCK = (4, 8)
W = "model.layers.0.mlp.up_proj.weight"


def _weight() -> np.ndarray:
    """[10, 20]: partial edge blocks; a block of zeros (scale 1), one with a NaN (scale 1), one with an infinity
    (scale 0: weight_scale_inv +inf), one of subnormals (scale inf: weight_scale_inv 0), the rest normal."""
    w = np.random.default_rng(46).standard_normal((10, 20)).astype(np.float32)
    w[0:4, 0:8] = 0.0
    w[1, 9] = np.nan
    w[4, 17] = np.inf
    w[8:10, 16:20] = 1e-40
    return w


def build(out: Path, q: np.ndarray, inv: np.ndarray, shard: int = 10**6) -> Path:
    tensors = {W: q, W + "_scale_inv": inv, "model.norm.weight": np.ones(20, np.float32)}
    dtypes = {W: "float8_e4m3fn", W + "_scale_inv": "float32", "model.norm.weight": "float32"}
    specs = [TensorSpec(n, a.shape, dtypes[n]) for n, a in tensors.items()]
    plan = build_export_plan(specs, shard)
    staging = commit.new_staging_dir(out, "hf-step-000001", "run")
    w = SnapshotWriter(plan, staging)
    for n, a in tensors.items():
        w.put(n, a)
    files = {k: (v.bytes, v.digest) for k, v in w.close().items()}
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}
    commit.write_json_durable(staging / "config.json", config)
    extra = ["config.json"] + ([commit.INDEX] if plan.needs_index else [])
    if plan.needs_index:
        commit.write_json_durable(staging / commit.INDEX, plan.index())
    files.update(describe_files(staging, extra))
    manifest = {"manifest_version": 1, "step": 1, "num_tensors": len(tensors), "run": {"id": "run", "seq": 1},
                "files": {k: {"bytes": b, checksum.DEFAULT: h} for k, (b, h) in files.items()}}
    commit.write_json_durable(staging / commit.MANIFEST, manifest)
    return commit.commit_staging(staging, out, "hf-step-000001")


def quantized():
    with np.errstate(all="ignore"):
        return ref.quantize(_weight(), BLOCK)


def test_the_rules_bytes_verify_special_blocks_included(tmp_path):
    q, inv = quantized()
    assert {1.0, 0.0, np.inf} <= set(inv.reshape(-1).tolist())  # the special scales are there
    report = verify_snapshot(build(tmp_path, q, inv))
    assert report.ok, report.errors


def test_a_block_whose_rows_were_never_written_is_named(tmp_path):
    """The defect of issue 46: a run of rows of a block column left as the scratch held them (here a stale pattern
    without a 448): the scale is right, the checksum agrees, the block is named with its rows and columns."""
    q, inv = quantized()
    q[4:8, 8:16] = 0x30  # block [1, 1] (its max among those rows)
    report = verify_snapshot(build(tmp_path, q, inv))
    assert not report.ok
    assert report.errors == [f"{W!r}: block [1, 1] (rows 4:8, columns 8:16) has weight_scale_inv {float(inv[1, 1]):.6g} "
                             "but no e4m3 code of magnitude 448: the rule maps each block's largest magnitude to 448, "
                             "so these bytes were not made by it (unwritten or damaged bytes, or scales of another "
                             "weight)"], report.errors


def test_scales_of_another_weight_and_impossible_scales(tmp_path, monkeypatch):
    """Every block damaged: the first few named, the rest counted; a NaN and a negative scale are named as scales the
    rule never gives."""
    q, inv = quantized()
    q = np.where((q & 0x7F) == 0x7E, q & 0xF0, q).astype(np.uint8)  # no 448 anywhere
    inv = inv.copy()
    inv[0, 1], inv[2, 0] = np.nan, -0.5
    monkeypatch.setattr(fp8_blocks, "MAX_BLOCKS_NAMED", 2)
    errors = verify_snapshot(build(tmp_path, q, inv)).errors
    assert errors[0] == f"{W!r}: block [0, 1] has weight_scale_inv nan, which the rule never gives (its scales' " \
                        "inverses are positive, 0 or +inf)"
    assert errors[1].startswith(f"{W!r}: block [2, 0] has weight_scale_inv -0.5, which the rule never gives")
    named = [e for e in errors if "no e4m3 code of magnitude 448" in e]
    scaled = int(np.sum(np.isfinite(inv) & (inv > 0) & (inv != 1)))
    assert len(named) == 2 and errors[-1] == f"{W!r}: ... and {scaled - 2} more blocks without a code of magnitude 448"


def test_only_a_check_of_the_bytes_reads_them(tmp_path):
    q, inv = quantized()
    q[:] = 0
    snap = build(tmp_path, q, inv, shard=150)  # several files: the weight and its scale apart
    assert len(json.loads((snap / commit.INDEX).read_text())["weight_map"]) == 3
    assert verify_snapshot(snap, check_hashes=False).ok
    assert not verify_snapshot(snap).ok


@pytest.mark.parametrize("seed", range(3))
def test_a_real_fp8_export_verifies(tmp_path, seed):
    """The writer's own FP8 weights (``host/quantize.py``, a transposed bfloat16 cast) pass the check."""
    from paddle_fullparam_callbacks.host.lazy import CastArray
    from paddle_fullparam_callbacks.host.quantize import Fp8Weight

    w = np.random.default_rng(seed).standard_normal((37, 53)).astype(np.float32)
    cast = CastArray(np.ascontiguousarray(w.T).T, "float32", "bfloat16", np.dtype(np.uint16))
    fp8 = Fp8Weight(cast, "bfloat16", BLOCK)
    report = verify_snapshot(build(tmp_path, fp8.weight.materialize(), fp8.scale_inv))
    assert report.ok, report.errors
