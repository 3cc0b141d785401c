"""Training stall per export with the parameters on an accelerator (the fake one) beside the CPU case.

Run (several minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/device_stall.py                 # -> bench/results/device_stall.json
    $PY bench/device_stall.py --reps 3
    $PY bench/device_stall.py --only cpu_async,device_async --reps 6 --result device_stall_async.json
    # also "before": each chosen variant run again with an older package (its directory first on PYTHONPATH)
    mkdir /tmp/pfc_before && git archive <commit> paddle_fullparam_callbacks | tar -x -C /tmp/pfc_before
    $PY bench/device_stall.py --only cpu_async,device_async --before-package /tmp/pfc_before

The ~670 MB float32 Llama of ``export_single.py``, single process, each variant in a fresh process,
interleaved; the loop of ``async_stall.py`` (``--exports`` exports with ``--train-seconds`` of idle
"training" between them). Variants: parameters on the CPU or on ``fakedev:0``; synchronous or
``export.async_write``; and a bfloat16 snapshot from the device with the default budget (the cast runs
on the device in chunks) and with budget 0 (the raw bytes come over, the host casts). For device
variants the peak of Paddle's allocator statistics during the exports, minus what the model held, is
recorded against ``export.device_memory_budget``. ``device_async_kernels``: the device with the plugin's
``contiguous`` kernel (``_fake_device.device_env(kernels=True)``), so that the Linear weights' transposes
can run on the device (elsewhere the device refuses them and the host's writer threads transpose).

Per export, besides its stall: where the training thread's time went (``/proc/thread-self/schedstat``:
on a CPU, waiting for one, and blocked: sleeping on a lock, a thread join, the GIL), the share of the
machine's CPU other processes used meanwhile (``_common.CpuShare``), and the copies off the device
(``DeviceBoundary._to_host`` calls). Ratios: of the medians over all exports, and paired (each rep's
device median over the same rep's CPU median, then the median of those), steadier on a shared machine.

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
VARIANTS = {  # name -> (device, async_write, export.dtype, export.device_memory_budget, contiguous kernel)
    "cpu_sync": ("cpu", False, "keep", None, False),
    "device_sync": ("fakedev", False, "keep", None, False),
    "cpu_async": ("cpu", True, "keep", None, False),
    "device_async": ("fakedev", True, "keep", None, False),
    "device_async_budget0": ("fakedev", True, "keep", "0", False),
    # transposes possible on the device (the fake one runs its kernel on the CPU, in the training thread)
    "device_async_kernels": ("fakedev", True, "keep", None, True),
    "device_bf16": ("fakedev", False, "bfloat16", None, False),
    "device_bf16_budget0": ("fakedev", False, "bfloat16", "0", False),
    "cpu_bf16": ("cpu", False, "bfloat16", None, False),
}
PAIRS = {"sync": ("device_sync", "cpu_sync"), "async": ("device_async", "cpu_async"),
         "async_budget0": ("device_async_budget0", "cpu_async"), "async_kernels": ("device_async_kernels", "cpu_async"),
         "bf16": ("device_bf16", "cpu_bf16")}
BEFORE = "@before"  # suffix of a variant run with --before-package


def _schedstat():
    """(seconds on a CPU, seconds runnable but waiting for one) of the calling thread so far."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting = f.read().split()[:2]
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def _instrument(session, per_export: list) -> None:
    """Record, for each ``session.export`` call, where the training thread's time went, what others used of
    the machine meanwhile, and the copies off the device."""
    import time

    from paddle_fullparam_callbacks.assemble import device as dev

    copies = [0]
    real_to_host = dev.DeviceBoundary._to_host

    def to_host(self, piece, dest):
        copies[0] += 1
        return real_to_host(self, piece, dest)

    dev.DeviceBoundary._to_host = to_host
    real_export = session.export

    def export(*a, **k):
        c0, (cpu0, wait0) = copies[0], _schedstat()
        with C.CpuShare() as share:
            t0 = time.perf_counter()
            info = real_export(*a, **k)
            wall = time.perf_counter() - t0
        cpu1, wait1 = _schedstat()
        per_export.append({"wall_s": round(wall, 4), "on_cpu_s": round(cpu1 - cpu0, 4),
                           "runqueue_s": round(wait1 - wait0, 4),
                           "blocked_s": round(wall - (cpu1 - cpu0) - (wait1 - wait0), 4),
                           "others_cpu_fraction": share.as_dict()["foreign_fraction"], "d2h_copies": copies[0] - c0})
        return info

    session.export = export


def child(variant: str, out: Path, exports: int, train_s: float) -> dict:
    import paddle

    device, async_write, dtype, budget, _kernels = VARIANTS[variant.removesuffix(BEFORE)]
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
    stalls, totals, per_export = [], [], []
    _instrument(session, per_export)
    _loop(session, source, exports, train_s, stalls, totals)
    peak = paddle.device.max_memory_allocated(name) - held if device != "cpu" else None
    from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot

    ok = all(verify_snapshot(out / f"hf-step-{s:06d}").ok for s in range(1, exports + 1))
    manifest = json.loads((out / f"hf-step-{exports:06d}" / "fullparam_manifest.json").read_text())
    return {"variant": variant, "stalls": stalls, "export_seconds": totals, "verified": ok, "places": places,
            "per_export": per_export,
            "device_peak_bytes": peak, "budget_bytes": cfg.export.device_budget,
            "device_to_host_s": manifest.get("timings", {}).get("device_to_host_s"),
            "model_bytes": C.parameter_bytes(model)}


def _env(variant: str, before: "str | None"):
    """The child's environment: the fake device's (with its kernel where the variant asks) for device
    variants; the older package first on PYTHONPATH for a ``@before`` run."""
    import os

    import _fake_device as fd

    device, *_, kernels = VARIANTS[variant.removesuffix(BEFORE)]
    env = fd.device_env(kernels=kernels) if device != "cpu" else dict(os.environ)
    if variant.endswith(BEFORE):
        env["PYTHONPATH"] = os.pathsep.join([before, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _paired(runs: dict, a: str, b: str) -> "float | None":
    """Median over reps of (a's median stall in rep i) / (b's median stall in rep i)."""
    n = min(len(runs.get(a, [])), len(runs.get(b, [])))
    if not n:
        return None
    return round(C.median([C.median(runs[a][i]["stalls"]) / C.median(runs[b][i]["stalls"]) for i in range(n)]), 3)


def _breakdown(rs: list) -> dict:
    """Medians over every export of the runs: the training thread's time split, others' CPU share, copies."""
    rows = [e for r in rs for e in r.get("per_export", [])]
    keys = ("wall_s", "on_cpu_s", "runqueue_s", "blocked_s", "others_cpu_fraction", "d2h_copies")
    return {k: round(C.median([e[k] for e in rows]), 4) for k in keys} if rows else {}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=[*VARIANTS, *(v + BEFORE for v in VARIANTS)])
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=C.tiny(2, 1))
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--train-seconds", type=float, default=C.tiny(6.0, 0.2))
    # tiny mode (bench/_common.py): one pair (the target's) and the device's bfloat16 cast with a budget
    ap.add_argument("--only", default=C.tiny("", "cpu_async,device_async,device_bf16_budget0"),
                    help="comma-separated variants (default: all; the ratios need their pairs)")
    ap.add_argument("--before-package", help="a directory holding an older paddle_fullparam_callbacks: every chosen "
                                             "variant also runs with it (NAME@before), interleaved")
    ap.add_argument("--result", default=RESULT_PATH.name, help="file name under bench/results/")
    ap.add_argument("--quiet-wait", type=float, default=C.tiny(60.0, 0.0), help="seconds to wait at most for an idle "
                                                                                "machine before each run")
    ns = ap.parse_args()
    if ns.variant:
        print(json.dumps(child(ns.variant, Path(ns.out), ns.exports, ns.train_seconds)))
        return
    chosen = [v for v in VARIANTS if not ns.only or v in ns.only.split(",")]
    names = [n for v in chosen for n in ([v, v + BEFORE] if ns.before_package else [v])]
    before = str(Path(ns.before_package).resolve()) if ns.before_package else None
    runs = {n: [] for n in names}
    quiet = []
    for rep in range(ns.reps):
        for n in names:
            tmp = Path(tempfile.mkdtemp(prefix="pfc_devstall_"))
            quiet.append(C.wait_quiet(ns.quiet_wait))
            try:
                r = C.run_child([__file__, "--variant", n, "--out", str(tmp / "out"), "--exports", str(ns.exports),
                                 "--train-seconds", str(ns.train_seconds)], env=_env(n, before))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            runs[n].append(r)
            print(f"rep {rep} {n:28s}: stalls {[round(x, 2) for x in r['stalls']]} s, blocked "
                  f"{[e['blocked_s'] for e in r['per_export']]}, others {[e['others_cpu_fraction'] for e in r['per_export']]}, "
                  f"copies {[e['d2h_copies'] for e in r['per_export']]}, device peak {r['device_peak_bytes']}, "
                  f"verified {r['verified']}", flush=True)
    stall = {n: C.median([s for r in runs[n] for s in r["stalls"]]) for n in names}
    is_device = {n: VARIANTS[n.removesuffix(BEFORE)][0] != "cpu" for n in names}
    peak = {n: max((r["device_peak_bytes"] or 0) for r in runs[n]) if is_device[n] else None for n in names}
    budget = {n: runs[n][0]["budget_bytes"] for n in names}
    pairs = {k + suffix: (a + suffix, b + suffix) for k, (a, b) in PAIRS.items() for suffix in ("", BEFORE)}
    result = {
        "benchmark": "device_stall",
        "model_bytes": runs[names[0]][0]["model_bytes"],
        "repetitions": ns.reps, "exports_per_run": ns.exports, "train_seconds_between_exports": ns.train_seconds,
        "variants": {v: dict(zip(("device", "async_write", "dtype", "budget", "contiguous_kernel"), VARIANTS[v]))
                     for v in chosen},
        "before_package": before,
        "stall_seconds": stall,
        "stall_ratio_device_over_cpu": {k: round(stall[a] / stall[b], 3) for k, (a, b) in pairs.items()
                                        if a in stall and b in stall},
        "stall_ratio_device_over_cpu_paired": {k: _paired(runs, a, b) for k, (a, b) in pairs.items()
                                               if a in stall and b in stall},
        "stall_ratio_after_over_before_paired": {v: _paired(runs, v, v + BEFORE) for v in chosen if v + BEFORE in runs},
        "target": "stall_ratio_device_over_cpu.async <= 1.3 (issue 32)",
        "training_thread_per_export": {n: _breakdown(runs[n]) for n in names},
        "device_peak_bytes": peak, "budget_bytes": budget,
        "within_budget": {n: peak[n] <= budget[n] for n in names if peak[n] is not None},
        "verified": all(r["verified"] for rs in runs.values() for r in rs),
        "quiet_before_runs": quiet, "all_runs": runs,
        "notes": ["fake accelerator: device memory is host memory, a device-to-host copy is a host memcpy, casts run "
                  "on Paddle's CPU kernel, nothing is asynchronous; the allocator statistics and the code path are real",
                  "training is time.sleep between exports (a GPU job's idle host CPU), as in async_stall.py",
                  "training_thread_per_export: medians over every export; blocked = wall - on a CPU - waiting for one"],
    }
    C.write_result(C.RESULTS_DIR / ns.result, result)
    print(json.dumps({k: result[k] for k in ("stall_seconds", "stall_ratio_device_over_cpu",
                                             "stall_ratio_device_over_cpu_paired", "stall_ratio_after_over_before_paired",
                                             "training_thread_per_export", "device_peak_bytes", "within_budget",
                                             "verified")}, indent=1))


if __name__ == "__main__":
    main()
