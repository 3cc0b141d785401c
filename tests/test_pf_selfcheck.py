"""``paddle-fullparam selfcheck`` as a user runs it: real launches, real fleet topologies, real exports.

On CPU (4 ranks: mp2 x pp2) it passes and says what it ran on; a rank killed in the middle of an
export makes it FAIL in seconds (the launcher stops the job; nothing hangs); bad usage is refused.
The fake accelerator's run is in tests/test_fake_device_export.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import ROOT

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]


def selfcheck(*args, env=None, timeout=400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "selfcheck", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_selfcheck_passes_on_cpu_with_four_ranks(tmp_path):
    res = selfcheck("--device", "cpu", "--nproc", "4", "--keep", str(tmp_path / "work"))
    out = res.stdout
    assert res.returncode == 0 and out.rstrip().endswith("PASS"), out + res.stderr
    assert "Paddle 3.3.1, device cpu" in out and "4 rank(s): mp2 x pp2 x dp1" in out
    assert "training: gloo" in out and "export: gloo groups over host memory" in out
    assert "parameters   on Place(cpu)" in out
    assert "keep     18 tensors" in out and "bfloat16 18 tensors" in out
    assert "bit for bit, an independent numpy assembly of the ranks' shards" in out
    # --keep: the snapshots stay, and they are what the check read
    snaps = sorted(p.name for p in (tmp_path / "work" / "snapshots").iterdir() if p.name.startswith("hf-step-"))
    assert snaps == ["hf-step-000001", "hf-step-000002"]


def test_a_rank_killed_during_the_export_is_a_fail_in_seconds_not_a_hang(tmp_path):
    t0 = time.perf_counter()
    res = selfcheck("--device", "cpu", "--nproc", "2", "--keep", str(tmp_path / "work"),
                    env={"PFC_FAULT_POINT": "tensor", "PFC_FAULT_RANK": "1"})
    out = res.stdout
    assert res.returncode == 1 and "\nFAIL" in out, out + res.stderr
    assert "rank(s) reported" in out or "error" in out
    assert time.perf_counter() - t0 < 200


def test_bad_usage_is_refused_before_anything_is_launched(tmp_path):
    res = selfcheck("--nproc", "0")
    assert res.returncode == 2 and "--nproc must be a whole number >= 1; got 0" in res.stderr
    res = selfcheck("--device", "nosuchdevice", "--nproc", "2")
    assert res.returncode == 1 and "FAIL: 2 rank(s) need 2 nosuchdevice device(s); this machine has 0" in res.stdout
