"""Crash safety: SIGKILL at 25 named points (planning, assembly, writing, commit, pointers,
retention, replacement), restart after each; no partial snapshot is ever visible, nothing
committed is damaged, the restart cleans up and exports normally. (`make faults`: longer.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "faults"))

import crash_loop  # noqa: E402

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]


def test_crash_loop(tmp_path):
    stats = crash_loop.run(crash_loop.POINTS, tmp_path / "out")
    assert stats["violations"] == []
    assert stats["kills"] >= 20, (stats["killed_at"], stats["not_reached"])
    assert stats["partial_snapshots_visible"] == 0 and stats["committed_snapshots_damaged"] == 0
    assert stats["final_exit"] == 0 and stats["leftovers_after_restart"] == []
    assert len(stats["final_snapshots"]) >= 2  # keep_last=2 (+ keep_best=1)


def test_crash_loop_four_ranks(tmp_path):
    # a rank killed while writing, the coordinator killed while committing; each launch restarts
    points = [("tensor@1", 1), ("manifest", 0), ("rename", 0)]
    stats = crash_loop.run_ranks(points, tmp_path / "out")
    assert stats["violations"] == [], stats
    assert stats["kills"] == 3, (stats["killed_at"], stats["not_reached"])
    assert stats["final_exit"] == 0 and stats["leftovers_after_restart"] == []
    assert stats["final_snapshots"]  # the restart exported and committed
