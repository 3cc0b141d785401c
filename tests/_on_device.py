"""What the one-process device tests of both environments share: ``tests/on_device/single.py`` run in a
child on the fake accelerator, and the checks of its report (``test_pf_on_device.py``,
``test_pnlp_on_device.py``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import _fake_device as fd
from _helpers import ROOT
from paddle_fullparam_callbacks import verify_snapshot


def single_process(framework: str, out: Path) -> dict:
    """tests/on_device/single.py in a child on the fake device; its report."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "on_device" / "single.py"), "--framework", framework,
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=fd.device_env(kernels=True))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("ONDEVICE ")][-1]
    return json.loads(line[len("ONDEVICE "):])


def check_single_process(report: dict) -> None:
    """Every case: parameters where they were put, the device within the budget, the same bytes from
    every placement."""
    budgets = {"llama_bf16_budget0": 0}
    assert set(report["cases"]) == {"llama", "llama_bf16", "llama_bf16_budget0", "llama_staged", "llama_chunks", "tied",
                                    "lora", "no_transpose", "llama_async", "slow_transposes", "fp8", "lora_fp8",
                                    "fp8_async"}
    for case, runs in report["cases"].items():
        budget = budgets.get(case, 16000)
        for where, run in runs.items():
            assert "error" not in run, (case, where, run["error"])
            placed = set(run["places"])
            assert placed == {"device": {"Place(fakedev:0)"}, "mixed": {"Place(fakedev:0)", "Place(cpu)"},
                              "cpu": {"Place(cpu)"}}[where], (case, where, run["places"])
            assert run["device_peak"] <= budget, (case, where, run["device_peak"], budget)
            assert ("device_to_host_s" in run["timings"]) == (where != "cpu"), (case, where, run["timings"])
        files = [run["files"] for run in runs.values()]
        assert files[0] and all(f == files[0] for f in files), (case, files)
        assert verify_snapshot(Path(runs["device"]["path"])).ok
    # the device-side cast used the budget it was given; with budget 0 nothing was allocated
    assert 0 < report["cases"]["llama_bf16"]["device"]["device_peak"] <= 16000
    assert report["cases"]["llama_bf16_budget0"]["device"]["device_peak"] == 0
    staged = report["cases"]["llama_staged"]
    assert staged["device"]["files"] == report["cases"]["llama_bf16"]["device"]["files"]
    # the embedding and the head alone are 16 chunks each (64 KB of bfloat16 in 4 KB chunks)
    assert staged["device"]["staged_chunks"] >= 32 and report["cases"]["llama_bf16"]["device"]["staged_chunks"] == 0
    assert report["cases"]["llama_chunks"]["device"]["files"] == report["cases"]["llama"]["device"]["files"]
    # without a staging buffer an uncast slice leaves the device in one copy (each copy off a custom device costs
    # Paddle a thread); through the staging buffer, in chunks
    for case in ("llama", "llama_async", "tied"):
        assert report["cases"][case]["device"]["copies_per_slice"] == [1], (case, report["cases"][case]["device"])
    assert max(report["cases"]["llama_chunks"]["device"]["copies_per_slice"]) > 1
    assert report["cases"]["llama_chunks"]["device"]["staged_chunks"] >= 32
    # a background export: the same bytes; every slice off the device went straight into the staging ring
    # (no second copy), the CPU parameters were copied in once, as from a CPU job
    runs = report["cases"]["llama_async"]
    assert runs["device"]["files"] == report["cases"]["llama"]["device"]["files"]
    assert runs["device"]["ring"]["arrays"] > 0 and runs["device"]["ring"]["copies"] == 0, runs["device"]["ring"]
    assert runs["mixed"]["ring"]["arrays"] > 0 and runs["mixed"]["ring"]["copies"] > 0, runs["mixed"]["ring"]
    assert runs["cpu"]["ring"]["arrays"] == 0 and runs["cpu"]["ring"]["copies"] > 0, runs["cpu"]["ring"]
    assert any(name.startswith("adapter/") for name in report["cases"]["lora"]["device"]["files"])
    # transposes to Hugging Face's layout: on the device where the budget allows (every Linear weight of a
    # mesh of one; of the LoRA model only its adapter's factors, the merged weights are merged on the host),
    # each a run of the device's contiguous kernel; with budget 0, on a device that refuses them, and for
    # CPU parameters on the host; the same bytes
    cases = report["cases"]
    for case in ("llama", "llama_bf16", "llama_staged", "llama_chunks", "tied"):
        dev = cases[case]["device"]
        assert dev["transposes_asked"] > 0 and dev["device_transposes"] == dev["transposes_asked"], (case, dev)
        assert dev["contiguous_calls"] >= dev["device_transposes"], (case, dev)
        assert 0 < cases[case]["mixed"]["device_transposes"] < dev["device_transposes"], case  # CPU ones on the host
    lora = cases["lora"]["device"]
    assert lora["device_transposes"] == lora["transposes_asked"] > 0  # the adapter's factors; merged weights not asked
    for case in ("llama_bf16_budget0", "no_transpose"):
        assert cases[case]["device"]["device_transposes"] == cases[case]["device"]["contiguous_calls"] == 0, case
    assert cases["no_transpose"]["device"]["files"] == cases["llama_bf16"]["device"]["files"]
    assert all(run["contiguous_calls"] == 0 for runs in cases.values() for run in (runs["cpu"],))
    # a background export on a device whose transposes are slower than its copies off it: judged on the second
    # transposed weight here, the rest left to the host's writer threads; the same bytes, still straight into the ring
    slow = cases["slow_transposes"]["device"]
    assert slow["device_transposes"] == 2 < slow["transposes_asked"], slow
    assert slow["files"] == cases["llama"]["device"]["files"]
    assert slow["ring"]["arrays"] > 0 and slow["ring"]["copies"] == 0, slow["ring"]
    check_fp8(cases)


def check_fp8(cases: dict) -> None:
    """FP8 on the device: the rule applied to the snapshot the same export makes without quantization (the
    device's bfloat16 cast, the LoRA merge), bit for bit; the PEFT adapter as it is; a background export the same."""
    import numpy as np

    from _fp8_reference import quantize, widen_bf16
    from _helpers import snapshot_tensors

    block = (32, 48)
    for case, plain_case in (("fp8", "llama_bf16"), ("lora_fp8", "lora")):
        got = snapshot_tensors(Path(cases[case]["device"]["path"]))
        plain = snapshot_tensors(Path(cases[plain_case]["device"]["path"]))
        quantized = sorted(k for k in got if k + "_scale_inv" in got)
        assert len(quantized) == 14 and set(got) == set(plain) | {k + "_scale_inv" for k in quantized}, case
        for k, v in plain.items():
            if k in quantized:
                q, inv = quantize(widen_bf16(v) if v.dtype == np.uint16 else v, block)
                assert got[k].tobytes() == q.tobytes() and got[k + "_scale_inv"].tobytes() == inv.tobytes(), (case, k)
            else:
                assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), (case, k)
    adapter = {n: d for n, d in cases["lora"]["device"]["files"].items() if n.startswith("adapter/")}
    assert adapter and adapter == {n: d for n, d in cases["lora_fp8"]["device"]["files"].items() if n.startswith("adapter/")}
    assert cases["fp8_async"]["device"]["files"] == cases["fp8"]["device"]["files"]
