"""Exports with the parameters on an accelerator (the fake one, ``fakedev``: tests/_fake_device.py).

What a job on a GPU does that a CPU job cannot show: where it allocates device memory. Each export
here is measured with Paddle's own allocator statistics (the peak during the export minus what was
held before it) against ``export.device_memory_budget``, and each snapshot must hold the bytes of the
same export from CPU tensors.

- One process (``tests/on_device/single.py``): a PaddleFormers Llama (untied: ``keep``, ``bfloat16`` cast
  on the device in chunks, ``bfloat16`` with budget 0), a tied one, a LoRA model merged with its PEFT
  adapter; each with every parameter on the device, with some offloaded to the CPU, and all on the CPU.
- 4 ranks, mp2 x pp2 (``tests/multirank/export_job.py``): Paddle's vocabulary-parallel embedding and
  tensor-parallel layers on ``fakedev:0..3``, bfloat16 snapshots of 4 steps, a 1 KB budget and 1 KB
  buckets, against the full tensors rebuilt with numpy from every rank's dumped shards.
- 4 ranks, PaddleFormers' ``LlamaForCausalLMPipe`` on pp2 x mp2 (the real pipeline and tensor-parallel
  classes, untied and tied; ``tests/multirank/pipe_job.py``), against the plain single-process model
  exported on the CPU; the untied one's FP8 export too (``pipe_job.FP8_CASES``).
- ``paddle-fullparam selfcheck --device fakedev --nproc 4``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import _fake_device as fd  # noqa: E402
from _on_device import check_single_process, single_process  # noqa: E402

from _helpers import snapshot_tensors  # noqa: E402
from paddle_fullparam_callbacks import verify_snapshot  # noqa: E402
from test_pf_multirank import expected_snapshot  # noqa: E402
from test_pf_pipe import _embedding_row_check  # noqa: E402

import pipe_job  # noqa: E402

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]

MESH_BUDGET, PIPE_BUDGET = 1000, 4000


def test_one_process_on_the_device_exports_the_cpu_bytes_within_the_budget(tmp_path):
    check_single_process(single_process("paddleformers", tmp_path))


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("on_device")
    mesh = fd.launch(ROOT / "tests" / "multirank" / "export_job.py",
                     ["--mp", "2", "--pp", "2", "--out", root / "mesh", "--device", "fakedev", "--budget",
                      str(MESH_BUDGET), "--bucket", "1KB", "--dtype", "bfloat16"],
                     nranks=4, log_dir=root / "log-mesh", timeout=420)
    assert mesh.rc == 0 and not mesh.timed_out, mesh.describe()
    pipe = fd.launch(ROOT / "tests" / "multirank" / "pipe_job.py",
                     ["--mp", "2", "--pp", "2", "--out", root / "pipe" / "pp2xmp2", "--device", "fakedev",
                      "--budget", str(PIPE_BUDGET), "--only", "llama,llama-tied"],
                     nranks=4, log_dir=root / "log-pipe", timeout=420)
    assert pipe.rc == 0 and not pipe.timed_out, pipe.describe()
    # the plain single-process models with the same values, exported on the CPU (no fake device here)
    ref = subprocess.run([sys.executable, str(ROOT / "tests" / "multirank" / "pipe_job.py"), "--reference",
                          str(root / "pipe"), "--topologies", "pp2xmp2", "--only", "llama,llama-tied"],
                         capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-4000:]
    return {"root": root, "mesh": [r for _, r in mesh.tagged("EXPORT")], "pipe": [r for _, r in pipe.tagged("PIPE")],
            "reference": json.loads((root / "pipe" / "reference.json").read_text())}


def test_a_four_rank_mesh_on_the_device_exports_the_shards_bytes_within_the_budget(launches):
    reports, root = launches["mesh"], launches["root"]
    assert len(reports) == 4
    for r in reports:
        assert r["places"] == [f"Place(fakedev:{r['rank']})"]
        assert r["errors"] == [[]] and r["events"][0] == ["every_n_steps@2", "save@3", "every_n_steps@4"]
        assert len(r["device_peaks"]) == 6 and all(p <= MESH_BUDGET for p in r["device_peaks"]), r["device_peaks"]
        assert all(s is not None and s > 0 for s in r["device_to_host_s"]), r
    for step in (2, 3, 4):
        snap = root / "mesh" / "builtin" / f"hf-step-{step:06d}"
        assert verify_snapshot(snap).ok
        got, want = snapshot_tensors(snap), expected_snapshot(root / "mesh" / "dump" / f"step-{step}", bf16=True)
        assert set(got) == set(want)
        for k in want:  # the vocabulary-parallel embedding (4 KB) and the head are over the 1 KB budget
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), (step, k)


@pytest.mark.parametrize("case", ["llama", "llama-tied"])
def test_paddleformers_pipe_with_tensor_parallelism_on_the_device_exports_the_plain_models_bytes(launches, case):
    reps = [r for r in launches["pipe"] if r["case"] == case]
    assert len(reps) == 4
    for r in reps:
        assert "export_error" not in r and r["errors"] == [] and r["values_set"], r
        assert r["places"] == [f"Place(fakedev:{r['rank']})"]
        assert r["device_peak"] is not None and r["device_peak"] <= PIPE_BUDGET, r["device_peak"]
    (snap,) = {s for r in reps for s in r["snapshots"]}
    ref_entry = launches["reference"][case]
    assert "fatal" not in ref_entry, ref_entry
    got, want = snapshot_tensors(Path(snap)), snapshot_tensors(Path(ref_entry["snapshot"]))
    assert set(got) == set(want)
    pipe_pad, plain_pad = ref_entry["pipe_padding_idx"], ref_entry["plain_padding_idx"]
    special = {}
    if pipe_pad != plain_pad:  # the Pipe's embedding has no padding index: its trained row is exported
        ref_notes = json.loads((Path(ref_entry["snapshot"]) / "fullparam_manifest.json").read_text())["model"]
        special = ref_notes.get("padding_rows_zeroed", {})
    for name in want:
        if name in special:
            _embedding_row_check(got, want, name, special[name], ref_entry["embedding_rows"][str(special[name])])
        else:
            assert got[name].tobytes() == want[name].tobytes(), name
    assert verify_snapshot(Path(snap)).ok
    if case in pipe_job.FP8_CASES:  # the FP8 export of the same step (a second callback, within the same budget)
        (fp8,) = {s for r in reps for s in r["fp8"]["snapshots"]}
        got, want = snapshot_tensors(Path(fp8)), snapshot_tensors(Path(ref_entry["fp8_snapshot"]))
        quantized = {k for k in got if k + "_scale_inv" in got}
        assert quantized and verify_snapshot(Path(fp8)).ok
        for k in quantized | {k + "_scale_inv" for k in quantized}:
            assert got[k].tobytes() == want[k].tobytes(), k


def test_selfcheck_passes_on_the_fake_accelerator(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "selfcheck", "--device", "fakedev",
                           "--nproc", "4", "--keep", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True,
                          timeout=400, env=fd.device_env())
    out = proc.stdout
    assert proc.returncode == 0 and out.rstrip().endswith("PASS"), out + proc.stderr[-3000:]
    assert "device fakedev (8 on this machine), 4 rank(s)" in out and "mp2 x pp2 x dp1" in out
    assert "training: xccl" in out and "parameters   on Place(fakedev:0)" in out
    peaks = [line for line in out.splitlines() if "device peak" in line]
    assert len(peaks) == 2 and all("budget 256KB" in line for line in peaks), out
