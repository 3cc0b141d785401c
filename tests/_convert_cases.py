"""What the convert tests of both environments share: real trainer checkpoints with the callback's
snapshot of the same step (``tests/multirank/convert_job.py``), and the comparison of a converted
snapshot with that snapshot."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import harness  # noqa: E402

from _helpers import snapshot_tensors  # noqa: E402

JOB = ROOT / "tests" / "multirank" / "convert_job.py"
SNAPSHOT = "snaps/hf-step-000002"
CHECKPOINT = "trainer/checkpoint-2"
UNIFIED = "uc/checkpoint-2"


def run_job(framework: str, mode: str, out: Path, *flags: str) -> None:
    """Train (or take a local step) and save checkpoint-2 with the callback exporting it too."""
    args = ["--framework", framework, "--mode", mode, "--out", str(out), *flags]
    if mode == "single":
        proc = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        reports = [json.loads(line[len("CONVERT_JOB "):]) for line in proc.stdout.splitlines()
                   if line.startswith("CONVERT_JOB ")]
        describe = proc.stderr[-3000:]
    else:
        res = harness.run_launch(JOB, args, nproc=2, log_dir=out / "log", timeout=400)
        assert res.rc == 0 and not res.timed_out, res.describe()
        reports = [r for _, r in res.tagged("CONVERT_JOB")]
        describe = res.describe()
    assert len(reports) == (1 if mode == "single" else 2), describe
    for r in reports:
        assert r["steps"] == [2] and r["errors"] == [], r
        if framework == "paddlenlp" and mode != "dp2":
            assert r.get("unified"), r.get("unified_error")
    assert (out / CHECKPOINT).is_dir() and (out / SNAPSHOT).is_dir()


def assert_same_snapshot(converted: Path, reference: Path) -> None:
    """Bit for bit the tensors and config of the callback's snapshot; the same files and index, unless the
    callback's job placed its files by where their bytes were (``topology.balance`` in its manifest: a
    pipeline job writes each stage's tensors in files of their own, which ``convert`` packs by name order);
    a manifest saying where it came from."""
    got, want = snapshot_tensors(converted), snapshot_tensors(reference)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert got[k].tobytes() == want[k].tobytes(), f"{k} differs from the callback's export"
    ref_topology = json.loads((reference / "fullparam_manifest.json").read_text())["topology"]
    placed = len(ref_topology.get("meshes", [[0]])[0]) > 1 and ref_topology.get("schedule") == "routed"
    if not placed:
        assert sorted(p.name for p in converted.iterdir()) == sorted(p.name for p in reference.iterdir())
        assert (converted / "model.safetensors.index.json").read_text() == (
            reference / "model.safetensors.index.json").read_text()
    else:
        index = [json.loads((d / "model.safetensors.index.json").read_text()) for d in (converted, reference)]
        assert set(index[0]["weight_map"]) == set(index[1]["weight_map"])
        assert index[0]["metadata"] == index[1]["metadata"]
    a, b = (json.loads((d / "config.json").read_text()) for d in (converted, reference))
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
    manifest = json.loads((converted / "fullparam_manifest.json").read_text())
    assert manifest["reason"] == "convert" and manifest["step"] == 2
    assert manifest["model"]["converted_from"]["step"] == 2


def damaged_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
