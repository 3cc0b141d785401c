"""Faults other than crashes: a full disk (RLIMIT_FSIZE), with on_error warn and raise."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from paddle_fullparam_callbacks import verify_snapshot

from _helpers import listing

pytestmark = pytest.mark.paddleformers
JOB = Path(__file__).resolve().parent / "faults" / "disk_full_job.py"


def _run(out, on_error):
    proc = subprocess.run([sys.executable, str(JOB), str(out), on_error], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_disk_full_warns_and_training_goes_on(tmp_path):
    r = _run(tmp_path / "out", "warn")
    assert r["events"] == ["step 1: ok", "step 2: ok", "step 3: ok"]  # training never stopped
    assert len(r["errors"]) == 1 and "step 2" in r["errors"][0] and "File too large" in r["errors"][0]
    assert r["snapshots"] == ["hf-step-000001", "hf-step-000003"]  # the next export works again
    assert listing(tmp_path / "out") == ["hf-step-000001", "hf-step-000003", "latest"]  # nothing half-written
    assert all(verify_snapshot(tmp_path / "out" / n).ok for n in r["snapshots"])


def test_disk_full_raises_when_asked(tmp_path):
    r = _run(tmp_path / "out", "raise")
    assert r["events"] == ["step 1: ok", "step 2: raised"]
    assert "File too large" in r["raised"] and "hf-step-000002" in r["raised"]
    assert listing(tmp_path / "out") == ["hf-step-000001", "latest"]
