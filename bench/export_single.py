"""Single-process export benchmark: this package vs PaddleFormers vs a raw sequential write.

Run (a few minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/export_single.py            # 3 interleaved repetitions -> bench/results/export_single.json
    $PY bench/export_single.py --reps 5   # more repetitions

What it measures, on one ~630 MB float32 PaddleFormers Llama (8 layers, hidden 1024, vocab 32000,
untied LM head, built with ``paddle.seed(0)``):

* ``ours``: ``ExportSession.export(source, step=1)`` of this package with ``hf_safetensors``,
  dtype ``keep`` and ``max_shard_size=5GB``: planning, name mapping, assembly, writing, hashing,
  fsync, index/config/manifest and the atomic commit, all inside the timed region.
* ``paddleformers``: ``model.save_pretrained(dir, save_checkpoint_format="flex_checkpoint",
  max_shard_size="5GB")`` (PaddleFormers' own HF-format safetensors save) followed by
  ``os.sync()``, both timed, so that it pays for durability like the others.
* ``raw``: the model's parameter bytes (numpy arrays obtained before timing) written with plain
  ``f.write`` into one file, then ``os.fsync``: the floor of what the disk allows.

Each repetition runs every variant in its own fresh Python process (this script re-invoked with
``--variant X --out DIR``), interleaved a, b, c, a, b, c, ..., each writing into a fresh
directory under /tmp that is deleted afterwards. The figures are medians over repetitions.
Inside a child, freed heap memory is returned to the OS (``malloc_trim``), the RSS baseline is
read right before the timed region, and the RSS is sampled every 2 ms in a background thread
during it; "peak extra RSS" = peak - baseline, reported as a fraction of the model's
parameter bytes. ``ru_maxrss`` (whole process life) is kept for reference.

Targets: raw/ours >= 0.85 (ours within ~15% of the disk's sequential speed) and ours' peak
extra RSS <= 0.25 x model bytes. ``--profile FILE`` (child only) wraps the timed call of a
variant in cProfile and dumps the stats to FILE.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = ("ours", "paddleformers", "raw")
PADDLEFORMERS_CALL = (
    'model.save_pretrained(out_dir, save_checkpoint_format="flex_checkpoint", max_shard_size="5GB"); os.sync()'
)
TARGETS = {"ratio_vs_raw": ">= 0.85", "peak_extra_rss_fraction.ours": "<= 0.25"}
RESULT_PATH = C.RESULTS_DIR / "export_single.json"


# ---- child side: one variant, one timed region ----------------------------------------------------
def _timed(fn, profile_path):
    """Run fn() under the RSS sampler (and cProfile if asked); returns (seconds, sampler, value)."""
    prof = None
    if profile_path:
        import cProfile

        prof = cProfile.Profile()
    gc.collect()
    C.trim_heap()
    with C.RssSampler(0.002) as sampler:
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        value = fn()
        if prof is not None:
            prof.disable()
        seconds = time.perf_counter() - t0
    if prof is not None:
        prof.dump_stats(profile_path)
    return seconds, sampler, value


def child(variant: str, out: Path, profile_path=None) -> dict:
    C.quiet_logs()
    t_build = time.perf_counter()
    model = C.build_llama(seed=0)
    build_s = time.perf_counter() - t_build
    model_bytes = C.parameter_bytes(model)
    out.mkdir(parents=True, exist_ok=True)
    result = {"variant": variant, "model_bytes": model_bytes, "build_seconds": build_s}

    if variant == "ours":
        from paddle_fullparam_callbacks.config import load_config
        from paddle_fullparam_callbacks.export import ExportSession
        from paddle_fullparam_callbacks.integrations.model_info import build_model_source

        cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=5GB"])
        session = ExportSession(cfg, cfg.output_dir)
        session.start()
        source = build_model_source(model, cfg)
        seconds, s, info = _timed(lambda: session.export(source, step=1), profile_path)
        result.update(
            snapshot_bytes=info.bytes, files=info.files, num_tensors=info.num_tensors,
            info_seconds=info.seconds, timings=dict(info.timings), peak_pending_bytes=info.peak_pending_bytes,
            written=C.tree_bytes(info.path),
        )
    elif variant == "paddleformers":
        target = out / "pf"

        def save():
            model.save_pretrained(str(target), save_checkpoint_format="flex_checkpoint", max_shard_size="5GB")
            os.sync()

        seconds, s, _ = _timed(save, profile_path)
        written = C.tree_bytes(target)
        if not any(k.endswith(".safetensors") for k in written):
            raise RuntimeError(f"save_pretrained wrote no safetensors file: {written}")
        result.update(written=written, snapshot_bytes=sum(written.values()))
    elif variant == "raw":
        import numpy as np

        seen, arrays = set(), []
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                arrays.append(np.ascontiguousarray(p.numpy()))
        path = out / "raw.bin"

        def write():
            with open(path, "wb") as f:
                for a in arrays:
                    f.write(a.data)
                f.flush()
                os.fsync(f.fileno())

        seconds, s, _ = _timed(write, profile_path)
        result.update(snapshot_bytes=path.stat().st_size, written={"raw.bin": path.stat().st_size})
    else:
        raise SystemExit(f"unknown variant {variant!r}")

    result.update(
        seconds=seconds,
        rss_baseline=s.baseline,
        rss_peak=s.peak,
        peak_extra_rss=s.extra,
        peak_extra_rss_fraction=s.extra / model_bytes,
        rss_samples=s.samples,
        ru_maxrss=C.ru_maxrss_bytes(),
    )
    return result


# ---- parent side: interleaved repetitions, summary ------------------------------------------------
def run_all(reps: int, variants, result_path: Path) -> dict:
    runs = {v: [] for v in variants}
    for rep in range(reps):
        for v in variants:
            tmp = Path(tempfile.mkdtemp(prefix=f"pfc-bench-{v}-", dir="/tmp"))
            try:
                r = C.run_child([__file__, "--variant", v, "--out", str(tmp / "out")])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                os.sync()  # the next variant starts with no dirty pages of this one
            runs[v].append(r)
            print(f"rep {rep + 1}/{reps} {v:>13}: {r['seconds']:6.2f} s, peak extra RSS "
                  f"{r['peak_extra_rss'] / 2**20:7.1f} MiB ({r['peak_extra_rss_fraction']:.3f} x model)", flush=True)
            time.sleep(1.0)

    model_bytes = runs[variants[0]][0]["model_bytes"]
    assert all(r["model_bytes"] == model_bytes for rs in runs.values() for r in rs)
    seconds = {v: C.median([r["seconds"] for r in rs]) for v, rs in runs.items()}
    rss_frac = {v: C.median([r["peak_extra_rss_fraction"] for r in rs]) for v, rs in runs.items()}
    out = {
        "benchmark": "export_single",
        "model": {"class": "paddleformers LlamaForCausalLM", "dtype": "float32", "config": C.LLAMA_KWARGS},
        "model_bytes": model_bytes,
        "repetitions": reps,
        "seconds": seconds,
        "all_seconds": {v: [r["seconds"] for r in rs] for v, rs in runs.items()},
        "throughput_gb_s": {v: model_bytes / 1e9 / s for v, s in seconds.items()},
    }
    if "ours" in seconds and "raw" in seconds:
        out["ratio_vs_raw"] = seconds["raw"] / seconds["ours"]
    if "ours" in seconds and "paddleformers" in seconds:
        out["ratio_vs_paddleformers"] = seconds["paddleformers"] / seconds["ours"]
    out["peak_extra_rss_fraction"] = rss_frac
    out["peak_extra_rss_bytes"] = {v: int(C.median([r["peak_extra_rss"] for r in rs])) for v, rs in runs.items()}
    out["all_peak_extra_rss_fraction"] = {v: [r["peak_extra_rss_fraction"] for r in rs] for v, rs in runs.items()}
    out["ru_maxrss_bytes"] = {v: [r["ru_maxrss"] for r in rs] for v, rs in runs.items()}
    out["rss_baseline_bytes"] = {v: [r["rss_baseline"] for r in rs] for v, rs in runs.items()}
    out["bytes_written"] = {v: rs[0]["snapshot_bytes"] for v, rs in runs.items()}
    out["files_written"] = {v: rs[0]["written"] for v, rs in runs.items()}
    if "ours" in runs:
        keys = sorted({k for r in runs["ours"] for k in r["timings"]})
        out["ours_timings_s"] = {k: C.median([r["timings"][k] for r in runs["ours"] if k in r["timings"]]) for k in keys}
        out["ours_peak_pending_bytes"] = int(C.median([r["peak_pending_bytes"] for r in runs["ours"]]))
    out["paddleformers_call"] = PADDLEFORMERS_CALL
    out["raw_call"] = "open(path, 'wb'); f.write(arr.data) per parameter; f.flush(); os.fsync(f.fileno())"
    out["targets"] = TARGETS
    met = {}
    if "ratio_vs_raw" in out:
        met["ratio_vs_raw"] = out["ratio_vs_raw"] >= 0.85
    if "ours" in rss_frac:
        met["peak_extra_rss_fraction.ours"] = rss_frac["ours"] <= 0.25
    out["met"] = met
    out["child_build_seconds_median"] = C.median([r["build_seconds"] for rs in runs.values() for r in rs])
    out["machine"] = C.machine_info()
    out["package_commit"] = C.git_commit()
    out["date"] = C.now_iso()
    C.write_json(result_path, out)
    return out


def print_table(res: dict) -> None:
    mb = res["model_bytes"]
    print(f"\nmodel_bytes = {mb} ({mb / 1e9:.3f} GB), {res['repetitions']} interleaved repetitions (medians)")
    print(f"{'variant':>14} {'seconds':>8} {'GB/s':>6} {'peak extra RSS':>15} {'x model':>8}")
    for v, s in res["seconds"].items():
        print(f"{v:>14} {s:8.2f} {mb / 1e9 / s:6.2f} {res['peak_extra_rss_bytes'][v] / 2**20:11.1f} MiB "
              f"{res['peak_extra_rss_fraction'][v]:8.3f}")
    for k in ("ratio_vs_raw", "ratio_vs_paddleformers"):
        if k in res:
            print(f"{k} = {res[k]:.3f}")
    if "ours_timings_s" in res:
        print("ours timings (median s): " + ", ".join(f"{k}={v:.3f}" for k, v in res["ours_timings_s"].items()))
    for k, ok in res["met"].items():
        print(f"target {k} {res['targets'][k]}: {'met' if ok else 'MISSED'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, help="(child) run one variant and print its JSON result")
    ap.add_argument("--out", type=Path, help="(child) directory to write into")
    ap.add_argument("--profile", help="(child) cProfile the timed region into this file")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (default: all)")
    ap.add_argument("--result", type=Path, default=RESULT_PATH, help=f"result JSON (default {RESULT_PATH})")
    args = ap.parse_args(argv)
    if args.variant:
        if args.out is None:
            ap.error("--variant needs --out")
        print(json.dumps(child(args.variant, args.out, args.profile)), flush=True)
        return 0
    variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}")
    res = run_all(max(1, args.reps), variants, args.result)
    print_table(res)
    print(f"\nwrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
