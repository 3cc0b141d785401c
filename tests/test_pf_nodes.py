"""Two nodes on one machine (two ``paddle.distributed.launch --nnodes 2`` launches, each in its own
working directory): a node-local output directory is refused at start on every rank; a shared one
gives the snapshots of a one-node run, bit for bit."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import harness  # noqa: E402
from nodes import run_two_nodes  # noqa: E402

JOB = ROOT / "tests" / "multirank" / "nodes_job.py"


def _nodes(tmp_path):
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in dirs:
        d.mkdir()
    return dirs


def _by_rank(*results):
    return {rank: obj for r in results for rank, obj in r.tagged("NODES")}


def _refusal(results, expected_key):
    by_rank = _by_rank(*results)
    assert sorted(by_rank) == [0, 1, 2, 3], "\n".join(r.describe() for r in results)
    messages = {o["error"] for o in by_rank.values()}
    assert len(messages) == 1, messages  # the same error on every rank
    message = messages.pop()
    assert message.startswith(f"ConfigError: {expected_key}: ")
    assert "is not the same directory on every rank: 2 of 4 ranks" in message
    assert "rank 2 on " in message and "rank 3 on " in message and "rank 1 on " not in message
    assert all(o["after_s"] < 60 for o in by_rank.values()), by_rank  # at start, within a minute
    assert all(r.rc != 0 for r in results)
    return message


def test_a_node_local_output_dir_is_refused_at_start_on_every_rank(tmp_path):
    node0, node1 = _nodes(tmp_path)
    results = run_two_nodes(JOB, ["--snaps", "snaps", "--trainer-dir", "trainer"], [node0, node1])
    message = _refusal(results, "output_dir")
    assert "'snaps'" in message and "the directory does not exist here" in message
    assert not (node0 / "snaps").exists() and not (node1 / "snaps").exists()  # nothing left behind


def test_a_node_local_checkpoint_directory_is_refused_for_the_checkpoint_hook(tmp_path):
    node0, node1 = _nodes(tmp_path)
    results = run_two_nodes(JOB, ["--snaps", tmp_path / "shared", "--trainer-dir", "trainer", "--hook"], [node0, node1])
    message = _refusal(results, "checkpoint_hook.enabled")
    assert "the trainer's output_dir (where the checkpoint hook commits) 'trainer'" in message


def _digests(snaps: Path) -> dict:
    out = {}
    for d in sorted(p for p in snaps.iterdir() if p.is_dir()):
        manifest = json.loads((d / "fullparam_manifest.json").read_text())
        out[d.name] = {name: f for name, f in manifest["files"].items()}
    return out


def test_a_shared_output_dir_on_two_nodes_gives_the_one_node_snapshots(tmp_path):
    node0, node1 = _nodes(tmp_path)
    two = run_two_nodes(JOB, ["--snaps", tmp_path / "two", "--trainer-dir", "trainer"], [node0, node1])
    assert all(r.rc == 0 for r in two), "\n".join(r.describe() for r in two)
    runs = _by_rank(*two)
    assert sorted(runs) == [0, 1, 2, 3] and all(o["errors"] == [] for o in runs.values())
    one = harness.run_launch(JOB, ["--snaps", tmp_path / "one", "--trainer-dir", tmp_path / "trainer1"], nproc=4,
                             timeout=240)
    assert one.rc == 0, one.describe()
    two_snaps, one_snaps = _digests(tmp_path / "two"), _digests(tmp_path / "one")
    assert list(two_snaps) == ["hf-step-000002", "hf-step-000004"]
    assert two_snaps == one_snaps  # every file's size and checksum
    assert (tmp_path / "two" / "latest").read_text() == (tmp_path / "one" / "latest").read_text()
