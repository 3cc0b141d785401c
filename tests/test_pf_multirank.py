"""Multi-rank export on CPU: real `paddle.distributed.launch`, real gloo collectives, real fleet
topologies and tensor-parallel layers, the real callback driven through the trainer's callback
handler. One launch per topology; each launch checks many things.

For every snapshot: the exported tensors equal, bit for bit, the full tensors rebuilt with plain
numpy from every rank's dumped shards (after the HF transposes); `verify` passes; every rank
took the same decisions. On the HV topologies, `assembler: paddle` (Paddle's own full_param)
exports byte-identical files.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import harness  # noqa: E402

from _helpers import LINEAR, listing, snapshot_tensors  # noqa: E402
from paddle_fullparam_callbacks import verify_snapshot  # noqa: E402

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]

TRANSPOSED = re.compile(r"(_proj\.weight|^lm_head\.weight)$")
TOPOLOGIES = {
    # a 1KB bucket: most slices travel as broadcasts, the small ones in many gather rounds
    "mp2xpp2": (["--mp", "2", "--pp", "2", "--paddle", "--seed", "--bucket", "1KB", "--chunk", "999"], 1, True),
    # a bfloat16 snapshot of float32 parameters: the holders cast before the bytes travel
    "dp2xmp2": (["--dp", "2", "--mp", "2", "--paddle", "--seed", "--dtype", "bfloat16"], 2, True),
    # bf16 parameters: the mesh path moves and stitches bfloat16 slices
    "sharding2xmp2": (["--sharding", "2", "--mp", "2", "--param-dtype", "bfloat16"], 2, False),
    "dp4": (["--dp", "4", "--dtype", "bfloat16"], 4, False),
}


def expected_snapshot(dump_dir: Path, bf16: bool) -> dict:
    full = harness.reassemble(dump_dir)
    out = {}
    for k, v in full.items():
        if bf16:
            v = harness._to_dtype(v, "bfloat16") if v.dtype == np.float32 else v
        out[k] = np.ascontiguousarray(v.T) if TRANSPOSED.search(k) else v
    return out


def check_traffic(manifest: dict, mp_mesh: bool) -> None:
    """The routed schedule's counts: each rank received what the plan predicted, never more than it wrote; a
    tensor-parallel (mp2) mesh moves about half of what it writes, nothing else moves."""
    assert manifest["topology"]["schedule"] == "routed"
    written = {int(r): sum(manifest["files"][f]["bytes"] for f in files_of(manifest, r))
               for r in manifest["topology"]["writers"]}
    snapshot = sum(m["bytes"] for f, m in manifest["files"].items() if f.endswith(".safetensors"))
    if not mp_mesh:  # meshes of one: nothing moves, nothing is counted
        assert "traffic" not in manifest
        return
    per_rank = manifest["traffic"]["per_rank"]
    assert len(per_rank) == 4
    for r, t in per_rank.items():
        assert t["received"] == t["predicted_received"] and t["sent"] == t["predicted_sent"], (r, t)
        assert t["received"] <= written.get(int(r), 0), (r, t, written)
    assert 0 < manifest["traffic"]["total"]["received"] <= 0.6 * snapshot, (manifest["traffic"], snapshot)


def files_of(manifest: dict, rank) -> list:
    """The file names a rank wrote (the manifest's writers list file indices in the index's file order)."""
    names = sorted(f for f in manifest["files"] if f.endswith(".safetensors"))
    return [names[i] for i in manifest["topology"]["writers"][str(rank)]]


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_multirank_export(tmp_path, topology):
    args, num_splits, differential = TOPOLOGIES[topology]
    res = harness.run_launch(ROOT / "tests" / "multirank" / "export_job.py", [*args, "--out", tmp_path], nproc=4,
                             log_dir=tmp_path / "log", timeout=420)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("EXPORT")]
    assert len(reports) == 4, res.describe()
    # every rank took the same decisions and saw no error
    assert all(r["events"] == reports[0]["events"] for r in reports)
    assert reports[0]["events"][0] == ["every_n_steps@2", "save@3", "every_n_steps@4"]
    assert all(r["errors"] == [[]] * len(r["errors"]) for r in reports)
    assert {r["num_splits"] for r in reports} == {num_splits}
    # writers work in parallel: more than one rank wrote files
    assert sum(1 for r in reports if r["files_written_here"][0]) >= 2
    bf16 = "bfloat16" in args
    for step in (2, 3, 4):
        snap = tmp_path / "builtin" / f"hf-step-{step:06d}"
        report = verify_snapshot(snap)
        assert report.ok, report.errors
        got = snapshot_tensors(snap)
        expected = expected_snapshot(tmp_path / "dump" / f"step-{step}", bf16)
        assert set(got) == set(expected)
        for k in expected:
            assert got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape, k
            assert got[k].tobytes() == expected[k].tobytes(), f"step {step}: {k} differs"
        manifest = json.loads((snap / "fullparam_manifest.json").read_text())
        assert manifest["topology"]["world_size"] == 4
        assert sorted(int(r) for r in manifest["topology"]["writers"]) == sorted(
            r["rank"] for r in reports if r["files_written_here"][0])
        check_traffic(manifest, "--mp" in args)
        if differential:
            other = json.loads((tmp_path / "paddle" / snap.name / "fullparam_manifest.json").read_text())
            shards = {f: m["blake3"] for f, m in manifest["files"].items() if f.endswith(".safetensors")}
            assert shards == {f: m["blake3"] for f, m in other["files"].items() if f.endswith(".safetensors")}
        if "--seed" in args:  # the seed schedule: the same tensors, and every rank of a mesh received them all
            seed_snap = tmp_path / "seed" / snap.name
            seeded = snapshot_tensors(seed_snap)
            assert set(seeded) == set(got) and all(seeded[k].tobytes() == got[k].tobytes() for k in got)
            seed_manifest = json.loads((seed_snap / "fullparam_manifest.json").read_text())
            assert seed_manifest["topology"]["schedule"] == "seed"
            assert seed_manifest["traffic"]["total"]["received"] > 2 * manifest["traffic"]["total"]["received"]
    assert (tmp_path / "builtin" / "latest").read_text().strip() == "hf-step-000004"
    assert not list((tmp_path / "builtin").glob(".tmp-*"))


def test_inconsistent_inputs_fail_on_every_rank_with_one_message(tmp_path):
    res = harness.run_launch(ROOT / "tests" / "multirank" / "bad_input_job.py", ["--out", tmp_path / "out"], nproc=4,
                             log_dir=tmp_path / "log", timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("BAD")]
    assert len(reports) == 4
    expected = {
        "global_shape_differs": "has global shape [16] on rank 0 but [32] on rank 1",
        "uncovered_elements": "hold 128 of its 256 elements",
        "overlapping_slices": "the slices overlap without being replicas",
        "replicas_differ": "with different values (replicas out of sync)",
        "plans_differ": "ranks computed different export plans",
    }
    for case, text in expected.items():
        messages = {r["cases"][case] for r in reports}
        assert len(messages) == 1, (case, messages)  # the same message on every rank
        assert text in messages.pop(), case
    # nothing of the failed exports is visible; the good one after them committed
    assert listing(tmp_path / "out") == ["hf-step-000008", "latest"]
    assert all(r["good"] == "hf-step-000008" for r in reports)
    assert verify_snapshot(tmp_path / "out" / "hf-step-000008").ok


def test_pure_data_parallel_trainer_two_ranks(tmp_path):
    res = harness.run_launch(ROOT / "tests" / "multirank" / "trainer_dp_job.py", ["--out", tmp_path], nproc=2,
                             log_dir=tmp_path / "log", timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("TRAIN")]
    assert len(reports) == 2 and reports[0]["events"] == reports[1]["events"]
    assert reports[0]["decisions"] == reports[1]["decisions"]  # taken on rank 0, shared
    # evaluation comes before the save of the same step: one snapshot, then a shared skip
    assert reports[0]["events"] == ["every_n_steps@3", "evaluate@4", "every_n_steps@6", "evaluate@8"]
    assert "skip: step 4 already exported@4" in reports[0]["decisions"]
    assert all(r["errors"] == [] and r["num_splits"] == 2 for r in reports)
    assert all(r["files_written_here"][-1] > 0 for r in reports)  # both replicas wrote part of it
    snaps = tmp_path / "snaps"
    names = listing(snaps)
    assert names[0] == "best" and names[-1] == "latest" and "hf-step-000006" in names and "hf-step-000008" in names
    best = (snaps / "best").read_text().strip()
    losses = {n: json.loads((snaps / n / "fullparam_manifest.json").read_text())["metrics"].get("eval_loss")
              for n in names if n.startswith("hf-")}
    assert best in losses and losses[best] == min(v for v in losses.values() if v is not None)
    for name in ("hf-step-000006", "hf-step-000008"):
        assert verify_snapshot(snaps / name).ok
    final = dict(np.load(tmp_path / "final-rank0.npz"))
    other = dict(np.load(tmp_path / "final-rank1.npz"))
    assert all(np.array_equal(final[k], other[k]) for k in final)  # the replicas agree
    got = snapshot_tensors(snaps / "hf-step-000008")
    # tied: PaddleFormers' own mapping writes lm_head.weight too (its loaders read it; transformers
    # ties a head equal to the embedding)
    assert np.array_equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    assert set(got) == set(final)
    for k, v in final.items():  # HF layout: Linear weights transposed (PaddleFormers' LM head is [vocab, hidden] already)
        expected = np.ascontiguousarray(v.T) if LINEAR.search(k) and k != "lm_head.weight" else v
        assert got[k].tobytes() == expected.tobytes(), k


STALL_TIMEOUT_S = 5


def run_stalled_export(out: Path, timeout_s: float = STALL_TIMEOUT_S):
    """4 ranks exporting; rank 3 is SIGSTOPped after its third tensor. Returns (launch result,
    seconds from the export's start to the end of the whole job)."""
    import os
    import time

    env = {**os.environ, "PFC_FAULT_POINT": "tensor@3", "PFC_FAULT_SIGNAL": "STOP", "PFC_FAULT_RANK": "3"}
    res = harness.run_launch(ROOT / "tests" / "multirank" / "stall_job.py", [out, timeout_s], nproc=4, timeout=180, env=env)
    ended = time.time()
    started = max(t["time"] for _, t in res.tagged("EXPORT") if t["step"] == 1)
    return res, ended - started


def test_a_stalled_rank_ends_the_job_within_the_timeout(tmp_path):
    out = tmp_path / "out"
    res, seconds = run_stalled_export(out)
    assert not res.timed_out and res.rc != 0, res.describe()
    for rank in (0, 1, 2):  # every rank names the stopped one, and where the others are: its own watchdog
        # fired, or (a rank whose watchdog had not fired yet) its collective failed when the first ones ended
        assert re.search(r"export.timeout_s=5: rank %d(?: made no progress for 5 s in '[^']+' \(step 1\)|'s '[^']+' "
                         r"\(step 1\) failed after \d+ s \(.*\)), waiting for rank\(s\) \[3\] \(.*rank 3 not responding"
                         % rank, res.logs[rank]), res.describe()
    # the watchdog's own message above is the rule; this bounds the launcher's teardown around it (its polls,
    # its stop of the stopped rank: ~10 s idle), with room for a loaded 2-core machine
    assert seconds <= STALL_TIMEOUT_S + 45, (seconds, res.describe())
    # nothing half-written is visible, and the directory is free for the restart
    assert not (out / ".fullparam.lock").exists()
    assert [n for n in listing(out) if not n.startswith(".")] == []


def test_a_rank_later_than_glooss_timeout_does_not_break_the_export(tmp_path):
    """gloo gives up on a collective after 30 s and Paddle 3.3.1 lets no caller change that: the export's
    groups first meet in their own store, with no limit there (export.timeout_s is the limit). One rank
    of an mp2 job spends 35 s before the save event (a slow checkpoint save); the other waits in the
    decision exchange, and every snapshot is committed, bit for bit."""
    res = harness.run_launch(ROOT / "tests" / "multirank" / "export_job.py",
                             ["--mp", "2", "--out", tmp_path, "--late", "35"], nproc=2, log_dir=tmp_path / "log",
                             timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("EXPORT")]
    assert len(reports) == 2 and all(r["errors"] == [[]] for r in reports), reports
    assert all(r["events"][0] == ["every_n_steps@2", "save@3", "every_n_steps@4"] for r in reports)
    for step in (2, 3, 4):
        snap = tmp_path / "builtin" / f"hf-step-{step:06d}"
        got, want = snapshot_tensors(snap), expected_snapshot(tmp_path / "dump" / f"step-{step}", False)
        assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}
