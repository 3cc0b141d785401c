"""Training stall per export: synchronous writes vs ``export.async_write``.

Run (half an hour; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/async_stall.py                 # -> bench/results/async_stall.json
    $PY bench/async_stall.py --reps 5
    # also "before": the defaults of an older commit (its package extracted into a directory)
    mkdir /tmp/pfc_before && git archive <commit> paddle_fullparam_callbacks | tar -x -C /tmp/pfc_before
    $PY bench/async_stall.py --before-package /tmp/pfc_before

Cases (``--cases``, ``layers:setting`` each): the float32 Llama of ``export_single.py`` with 8 layers
(~670 MB) and with 21 (twice that, ~1.34 GB), each with the defaults (``default``: no
``export.max_pending_bytes`` override) and with an explicit ring (``2GB``: it holds the whole
rank). ``--before-package DIR`` adds each model's ``default`` case run with the package in DIR (the
old default: a 512MB ring). ``--max-pending X`` alone is the old single case, ``--cases 8:X``.
Single process: every variant runs in its own fresh process, interleaved (each rep runs every
case, sync then async). A child makes ``--exports`` exports of consecutive steps through
``ExportSession`` with ``--train-seconds`` of "training" between them, then finishes as the
trainer's ``on_train_end`` would (``wait_pending``).

The stall of an export is the time the training thread spends in the exporter for it: the
``export()`` call itself, plus, for a background export, any time a *later* call (the next
export, or the end of training) has to wait for it to commit. Training is simulated with
``time.sleep``: on a GPU job the host CPU is mostly idle during steps, which is what lets the
background writer work; a CPU-bound simulation on this 2-core machine would measure the CPU
contention instead. ``stall_ratio`` = median async stall / median sync stall of the same case.
Targets: <= 0.35 with the explicit ring, <= 0.2 with the defaults.
The peak extra RSS is reported too, setup included: background writing keeps a staging ring in
host memory for the whole job (allocated and touched at ``on_train_begin``), so that no export
pays page faults: by default this rank's snapshot bytes within half the node's available memory
shared among its ranks, ``min(export.max_pending_bytes, this rank's snapshot bytes)`` when set.

The top-level ``stall_seconds``, ``stall_ratio``, ``model_bytes``, ... keep their meaning: the
8-layer model with ``max_pending_bytes`` (2GB); ``cases`` holds every case, ``stall_table`` the
ratios side by side.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "async_stall.json"
VARIANTS = ("sync", "async")
DEFAULT_CASES = C.tiny("8:default,8:2GB,21:default,21:2GB", "8:default,8:2GB")  # tiny: bench/_common.py
TARGETS = {"explicit": 0.35, "default": 0.2}


def child(variant: str, out: Path, exports: int, train_s: float, max_pending: str, layers: int) -> dict:
    C.quiet_logs()
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    model = C.build_llama(seed=0, layers=layers)
    model_bytes = C.parameter_bytes(model)
    overrides = [f"output_dir={out}", "export.max_shard_size=5GB",
                 f"export.async_write={'true' if variant == 'async' else 'false'}"]
    if max_pending != "default":  # default: the package's own default, whatever it is
        overrides.append(f"export.max_pending_bytes={max_pending}")
    cfg = load_config(None, overrides)
    session = ExportSession(cfg, out)
    session.start()
    source = build_model_source(model, cfg)
    C.trim_heap()
    before_prepare = C.rss_bytes()
    session.prepare(source)  # on_train_begin: the first plan, and (async) the host staging ring
    ring_bytes = session._ring.size if session._ring is not None else 0
    setup_extra = C.rss_bytes() - before_prepare
    stalls, totals = [], []
    with C.RssSampler(interval=0.01) as sampler:
        _loop(session, source, exports, train_s, stalls, totals)
    from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot

    ok = all(verify_snapshot(out / f"hf-step-{s:06d}").ok for s in range(1, exports + 1))
    return {"variant": variant, "stalls": stalls, "export_seconds": totals, "verified": ok,
            "peak_extra_rss_bytes": sampler.extra + setup_extra, "host_ring_bytes": ring_bytes,
            "model_bytes": model_bytes, "max_pending_bytes": str(cfg.export.max_pending_bytes),
            "mem_available_bytes": _mem_available()}


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _loop(session, source, exports, train_s, stalls, totals) -> None:
    for step in range(1, exports + 1):
        t = time.perf_counter()
        waited_before = 0.0
        if session.has_pending:  # the next export first waits for the previous one: that is stall too
            tw = time.perf_counter()
            info_prev = session.wait_pending()
            waited_before = time.perf_counter() - tw
            totals.append(info_prev.seconds)
            stalls[-1] += waited_before
        info = session.export(source, step, reason="bench")
        stalls.append(time.perf_counter() - t - waited_before)
        if not info.pending:
            totals.append(info.seconds)
        time.sleep(train_s)  # training goes on
    t = time.perf_counter()
    last = session.wait_pending()  # on_train_end
    if last is not None:
        stalls[-1] += time.perf_counter() - t
        totals.append(last.seconds)


def _cases(ns) -> list:
    """[(name, layers, setting, package dir or None)] in the order each rep runs them."""
    spec = f"8:{ns.max_pending}" if ns.max_pending else ns.cases
    cases = []
    for item in spec.split(","):
        layers, _, setting = item.strip().partition(":")
        cases.append((f"{layers}L:{setting}", int(layers), setting or "default", None))
    if ns.before_package:
        for layers in sorted({c[1] for c in cases}):
            cases.append((f"{layers}L:default:before", layers, "default", str(Path(ns.before_package).resolve())))
    return cases


def _child_env(package):
    if package is None:
        return None
    import os

    return dict(os.environ, PYTHONPATH=os.pathsep.join([package, *[p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]]))


def _summary(name, layers, setting, package, runs) -> dict:
    stall = {v: C.median([s for r in runs[v] for s in r["stalls"]]) for v in VARIANTS}
    total = {v: C.median([s for r in runs[v] for s in r["export_seconds"]]) for v in VARIANTS}
    rss = {v: C.median([r["peak_extra_rss_bytes"] for r in runs[v]]) for v in VARIANTS}
    model_bytes = runs["sync"][0]["model_bytes"]
    ratio = stall["async"] / stall["sync"]
    kind = "default" if setting == "default" else "explicit"
    out = {
        "case": name, "layers": layers, "max_pending_bytes": setting,
        "max_pending_bytes_as_configured": runs["async"][0].get("max_pending_bytes"),
        "package": "before (--before-package)" if package else "this checkout",
        "model_bytes": model_bytes, "host_ring_bytes": runs["async"][0].get("host_ring_bytes"),
        "stall_seconds": stall, "stall_seconds_all": {v: [s for r in runs[v] for s in r["stalls"]] for v in VARIANTS},
        "export_seconds": total, "stall_ratio": round(ratio, 4),
        "peak_extra_rss_bytes": rss,
        "peak_extra_rss_fraction": {v: round(rss[v] / model_bytes, 4) for v in VARIANTS},
        "mem_available_bytes": runs["async"][0].get("mem_available_bytes"),
        "verified": all(r["verified"] for v in VARIANTS for r in runs[v]),
    }
    if not package:
        out["target"] = f"<= {TARGETS[kind]}"
        out["met"] = ratio <= TARGETS[kind]
    return out


def _pooled_ratios(summaries) -> None:
    """Adds ``stall_ratio_pooled_sync``: the async stall over the median of every synchronous stall of
    the same model, all cases together (the synchronous path is alike in each: only its budget differs),
    a steadier denominator than one case's three runs on a shared machine."""
    for c in summaries:
        pooled = C.median([s for o in summaries if o["layers"] == c["layers"] for s in o["stall_seconds_all"]["sync"]])
        c["sync_stall_pooled_seconds"] = pooled
        c["stall_ratio_pooled_sync"] = round(c["stall_seconds"]["async"] / pooled, 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--train-seconds", type=float, default=C.tiny(6.0, 0.2))
    ap.add_argument("--layers", type=int, default=8, help="child: num_hidden_layers of the Llama")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="layers:max_pending_bytes, comma separated "
                                                           "(default: no override, the package's default)")
    ap.add_argument("--max-pending", help="one case, --cases 8:X (child: export.max_pending_bytes, or default)")
    ap.add_argument("--before-package", help="a directory holding an older paddle_fullparam_callbacks: adds each "
                                             "model's default case run with it")
    ns = ap.parse_args()
    if ns.variant:
        print(json.dumps(child(ns.variant, Path(ns.out), ns.exports, ns.train_seconds, ns.max_pending or "default",
                               ns.layers)))
        return
    cases = _cases(ns)
    runs = {c[0]: {v: [] for v in VARIANTS} for c in cases}
    quiet = []
    for rep in range(ns.reps):
        for name, layers, setting, package in cases:
            for v in VARIANTS:
                tmp = Path(tempfile.mkdtemp(prefix="pfc_async_"))
                quiet.append(C.wait_quiet(180))
                try:
                    r = C.run_child([__file__, "--variant", v, "--out", str(tmp / "out"), "--exports", str(ns.exports),
                                     "--train-seconds", str(ns.train_seconds), "--max-pending", setting,
                                     "--layers", str(layers)], env=_child_env(package))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                runs[name][v].append(r)
                print(f"rep {rep} {name:18s} {v:5s}: ring {r['host_ring_bytes'] / 1e6:.0f} MB, stalls "
                      f"{[round(x, 2) for x in r['stalls']]} s, exports {[round(x, 2) for x in r['export_seconds']]} s, "
                      f"verified {r['verified']}", flush=True)
    summaries = [_summary(name, layers, setting, package, runs[name]) for name, layers, setting, package in cases]
    _pooled_ratios(summaries)
    legacy = next((c for c in summaries if c["layers"] == 8 and c["max_pending_bytes"] not in ("default",)
                   and c["package"] == "this checkout"), summaries[0])
    legacy_runs = runs[legacy["case"]]
    result = {
        "benchmark": "async_stall",
        "model_bytes": legacy["model_bytes"],
        "repetitions": ns.reps, "exports_per_run": ns.exports, "train_seconds_between_exports": ns.train_seconds,
        "max_pending_bytes": legacy["max_pending_bytes"],
        "stall_seconds": legacy["stall_seconds"], "export_seconds": legacy["export_seconds"],
        "stall_ratio": legacy["stall_ratio"],
        "peak_extra_rss_fraction": legacy["peak_extra_rss_fraction"],
        "all_runs": legacy_runs,
        "verified": all(c["verified"] for c in summaries),
        "targets": {"stall_ratio": "<= 0.35", "cases.stall_ratio (defaults)": "<= 0.2"},
        "met": {"stall_ratio": legacy["stall_ratio"] <= 0.35,
                "defaults": all(c["met"] for c in summaries if c.get("met") is not None
                                and c["max_pending_bytes"] == "default")},
        "host_ring_bytes": legacy["host_ring_bytes"],
        "cases": summaries,
        "stall_table": [{k: c[k] for k in ("case", "package", "model_bytes", "host_ring_bytes", "stall_ratio",
                                           "stall_ratio_pooled_sync")}
                        | {"sync_s": round(c["stall_seconds"]["sync"], 4), "async_s": round(c["stall_seconds"]["async"], 4),
                           "async_peak_extra_rss_bytes": c["peak_extra_rss_bytes"]["async"]} for c in summaries],
        "all_case_runs": runs,
        "quiet_checks": {"busy_runs": sum(not q["quiet"] for q in quiet), "max_waited_s": max(q["waited_s"] for q in quiet),
                         "all": quiet},
        "notes": ["training is time.sleep between exports (GPU-job-like idle host CPU); the stall of a "
                  "background export includes any wait a later call has for it",
                  "async keeps a pre-faulted host staging ring for the job's lifetime (host_ring_bytes): by default "
                  "this rank's snapshot bytes within half the node's MemAvailable shared among its ranks "
                  "(PADDLE_LOCAL_SIZE), min(max_pending_bytes, snapshot bytes) when set; it is counted in "
                  "peak_extra_rss_fraction.async",
                  "the top-level fields are the 8-layer model with the explicit max_pending_bytes, as before; "
                  "'before' cases ran the package given by --before-package (the old default: a 512MB ring, "
                  "and a writer that queued at most half its 512MB budget)"],
    }
    C.write_result(RESULT_PATH, result)
    print()
    for c in summaries:
        print(f"{c['case']:18s} ({c['model_bytes'] / 1e6:.0f} MB, ring {c['host_ring_bytes'] / 1e6:.0f} MB): stall sync "
              f"{c['stall_seconds']['sync']:.2f} s, async {c['stall_seconds']['async']:.2f} s -> {c['stall_ratio']:.3f}"
              + (f" (target {c['target']}: {'met' if c['met'] else 'NOT met'})" if "target" in c else "")
              + f"; peak extra RSS async {c['peak_extra_rss_fraction']['async']:.2f}x model bytes")


if __name__ == "__main__":
    main()
