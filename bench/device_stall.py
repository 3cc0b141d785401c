"""Training stall per export with the parameters on an accelerator (the fake one) beside the CPU case.

Run (several minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/device_stall.py                 # -> bench/results/device_stall.json
    $PY bench/device_stall.py --reps 3

The ~670 MB float32 Llama of ``export_single.py``, single process, each variant in a fresh process,
interleaved; the loop of ``async_stall.py`` (``--exports`` exports with ``--train-seconds`` of idle
"training" between them). Variants: parameters on the CPU or on ``fakedev:0``; synchronous or
``export.async_write``; and a bfloat16 snapshot from the device with the default budget (the cast runs
on the device in chunks) and with budget 0 (the raw bytes come over, the host casts). For device
variants the peak of Paddle's allocator statistics during the exports, minus what the model held, is
recorded against ``export.device_memory_budget``.

What is and is not like a GPU: the fake accelerator's memory is host memory, so its device-to-host
"copies" are host memcpys (a GPU's run over PCIe or NVLink-C2C at 10-50 GB/s, into pinned memory at
full speed, pageable at about half); its casts fall back to Paddle's CPU kernel (a GPU casts at
hundreds of GB/s); nothing runs asynchronously. The allocator statistics, the code path (chunks,
budget, host assembly) and the bytes are the real thing; the seconds are this machine's.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import _common as C  # noqa: E402
from async_stall import _loop  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "device_stall.json"
VARIANTS = {  # name -> (device, async_write, export.dtype, export.device_memory_budget)
    "cpu_sync": ("cpu", False, "keep", None),
    "device_sync": ("fakedev", False, "keep", None),
    "cpu_async": ("cpu", True, "keep", None),
    "device_async": ("fakedev", True, "keep", None),
    # budget 0: no transposes on the device (the fake one runs them on the CPU, in the training thread)
    "device_async_budget0": ("fakedev", True, "keep", "0"),
    "device_bf16": ("fakedev", False, "bfloat16", None),
    "device_bf16_budget0": ("fakedev", False, "bfloat16", "0"),
    "cpu_bf16": ("cpu", False, "bfloat16", None),
}


def child(variant: str, out: Path, exports: int, train_s: float) -> dict:
    import paddle

    device, async_write, dtype, budget = VARIANTS[variant]
    C.quiet_logs()
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    model = C.build_llama(seed=0, device=f"{device}:0" if device != "cpu" else "cpu")
    places = sorted({str(p.place) for p in model.parameters()})
    overrides = [f"output_dir={out}", "export.max_shard_size=5GB", "export.max_pending_bytes=2GB",
                 f"export.async_write={'true' if async_write else 'false'}", f"export.dtype={dtype}"]
    if budget is not None:
        overrides.append(f"export.device_memory_budget={budget}")
    cfg = load_config(None, overrides)
    session = ExportSession(cfg, out)
    session.start()
    source = build_model_source(model, cfg)
    session.prepare(source)
    name = f"{device}:0"
    if device != "cpu":
        paddle.device.reset_max_memory_allocated(name)
        held = paddle.device.memory_allocated(name)
    stalls, totals = [], []
    _loop(session, source, exports, train_s, stalls, totals)
    peak = paddle.device.max_memory_allocated(name) - held if device != "cpu" else None
    from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot

    ok = all(verify_snapshot(out / f"hf-step-{s:06d}").ok for s in range(1, exports + 1))
    manifest = json.loads((out / f"hf-step-{exports:06d}" / "fullparam_manifest.json").read_text())
    return {"variant": variant, "stalls": stalls, "export_seconds": totals, "verified": ok, "places": places,
            "device_peak_bytes": peak, "budget_bytes": cfg.export.device_budget,
            "device_to_host_s": manifest.get("timings", {}).get("device_to_host_s"),
            "model_bytes": C.parameter_bytes(model)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=list(VARIANTS))
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=C.tiny(2, 1))
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--train-seconds", type=float, default=C.tiny(6.0, 0.2))
    # tiny mode (bench/_common.py): one pair (the target's) and the device's bfloat16 cast with a budget
    ap.add_argument("--only", default=C.tiny("", "cpu_async,device_async,device_bf16_budget0"),
                    help="comma-separated variants (default: all; the ratios need their pairs)")
    ns = ap.parse_args()
    if ns.variant:
        print(json.dumps(child(ns.variant, Path(ns.out), ns.exports, ns.train_seconds)))
        return
    import _fake_device as fd

    env = fd.device_env()
    chosen = [v for v in VARIANTS if not ns.only or v in ns.only.split(",")]
    runs = {v: [] for v in chosen}
    quiet = C.wait_quiet()
    for rep in range(ns.reps):
        for v in chosen:
            device = VARIANTS[v][0]
            tmp = Path(tempfile.mkdtemp(prefix="pfc_devstall_"))
            try:
                r = C.run_child([__file__, "--variant", v, "--out", str(tmp / "out"), "--exports", str(ns.exports),
                                 "--train-seconds", str(ns.train_seconds)], env=env if device != "cpu" else None)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            runs[v].append(r)
            print(f"rep {rep} {v:20s}: stalls {[round(x, 2) for x in r['stalls']]} s, device peak "
                  f"{r['device_peak_bytes']}, d2h {r['device_to_host_s']}, verified {r['verified']}", flush=True)
    stall = {v: C.median([s for r in runs[v] for s in r["stalls"]]) for v in chosen}
    peak = {v: max((r["device_peak_bytes"] or 0) for r in runs[v]) if VARIANTS[v][0] != "cpu" else None
            for v in chosen}
    budget = {v: runs[v][0]["budget_bytes"] for v in chosen}
    pairs = {"sync": ("device_sync", "cpu_sync"), "async": ("device_async", "cpu_async"),
             "async_budget0": ("device_async_budget0", "cpu_async"), "bf16": ("device_bf16", "cpu_bf16")}
    result = {
        "benchmark": "device_stall",
        "model_bytes": runs[chosen[0]][0]["model_bytes"],
        "repetitions": ns.reps, "exports_per_run": ns.exports, "train_seconds_between_exports": ns.train_seconds,
        "variants": {v: dict(zip(("device", "async_write", "dtype", "budget"), VARIANTS[v])) for v in chosen},
        "stall_seconds": stall,
        "stall_ratio_device_over_cpu": {k: round(stall[a] / stall[b], 3) for k, (a, b) in pairs.items()
                                        if a in stall and b in stall},
        "target": "stall_ratio_device_over_cpu.async <= 1.3 (issue 32)",
        "device_peak_bytes": peak, "budget_bytes": budget,
        "within_budget": {v: peak[v] <= budget[v] for v in chosen if peak[v] is not None},
        "verified": all(r["verified"] for rs in runs.values() for r in rs),
        "quiet_before_runs": quiet, "all_runs": runs,
        "notes": ["fake accelerator: device memory is host memory, a device-to-host copy is a host memcpy, casts run "
                  "on Paddle's CPU kernel, nothing is asynchronous; the allocator statistics and the code path are real",
                  "training is time.sleep between exports (a GPU job's idle host CPU), as in async_stall.py"],
    }
    C.write_result(RESULT_PATH, result)
    print(json.dumps({k: result[k] for k in ("stall_seconds", "stall_ratio_device_over_cpu", "device_peak_bytes",
                                             "within_budget", "verified")}, indent=1))


if __name__ == "__main__":
    main()
