"""``paddle-fullparam convert`` benchmark: time and memory of converting a ~670 MB checkpoint on disk.

Run (a few minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/convert.py              # 3 interleaved repetitions -> bench/results/convert.json
    $PY bench/convert.py --reps 5
    git archive <commit> | tar -x -C /tmp/before && $PY bench/convert.py --reps 5 --before /tmp/before

The checkpoint: the ~673 MB float32 PaddleFormers Llama of every single-process benchmark
(``_common.LLAMA_KWARGS``: 8 layers, hidden 1024, vocab 32000, untied LM head), saved in the
PaddleFormers Trainer's flex-checkpoint format (``checkpoint-1/model_state/``, written by Paddle's
``save_state_dict``, the function the Trainer's save calls), with its config.json beside it.

Variants, each in a fresh process, interleaved a, b, c, a, b, c, ...:

* ``convert``: ``convert(checkpoint, out)`` with default settings (one process): index, checks,
  lazy model, plan, read, transpose, write, hash, fsync, commit, all timed;
* ``convert_workers2``: the same with ``workers=2`` (time only: the workers are other processes);
* ``raw_copy``: the checkpoint's data files copied by the kernel (``copy_file_range``) into one
  file, then ``fsync``: the floor of reading and writing the same bytes;
* ``convert_cold``: ``convert`` as the first conversion of this model on a machine: an empty folder of model
  descriptions (``convert/described.py``), so it imports the model class and builds the lazy model; ``convert``
  finds the description an untimed conversion before the rounds kept (issue 42: what every later conversion of the
  model does);
* ``convert_before`` (with ``--before TREE``): ``convert`` of that tree's package, in the same rounds
  (``before``: its figures beside this tree's, paired with the same raw copies).

Memory: the RSS of the converting process is sampled every 2 ms around the timed call (baseline
read right before it, after the imports); ``RssAnon`` (heap: what convert allocates) and
``RssFile`` (pages of the memory-mapped checkpoint counted while mapped) are reported apart, and
the RSS when the export starts (``rss_at_export``: what indexing, the lazily built model and the
model class's import added before any tensor byte is read). Targets: peak extra RSS (VmRSS)
<= 0.05 x the checkpoint's data bytes (issue 32; ``peak_extra_rss_ratio``), and the older
<= 0.1 x model bytes + the largest tensor (issue 13). Both variants read the checkpoint from the
page cache (it was just written or read; nothing here drops caches).

Also recorded per run: minor page faults of the timed call (``getrusage``), and for ``convert`` the
writer's own breakdown of its threads' time (``writer_convert``: fill = reading and transposing into
its buffers, hash, write, waits) and the seconds before the export starts (``prepare_s``: index,
config, model class, lazy model, mapping); ``median_paired_ratio_export_vs_raw_copy`` compares the
raw copy with the export alone (``timings.total_s``), to tell the two apart.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = ("convert", "convert_cold", "convert_workers2", "raw_copy")
RESULT_PATH = C.RESULTS_DIR / "convert.json"


def _status_kb() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


class StatusSampler:
    """Peaks of VmRSS, RssAnon and RssFile over the timed region (every ``interval`` seconds)."""

    def __init__(self, interval=0.002):
        self.interval, self._stop = interval, threading.Event()
        self.baseline, self.peak = {}, {}

    def _sample(self):
        for k, v in _status_kb().items():
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self):
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        self.baseline = _status_kb()
        self.peak = dict(self.baseline)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._sample()
        self._stop.set()
        self._t.join()

    def extra(self) -> dict:
        return {k: self.peak[k] - self.baseline.get(k, 0) for k in self.peak}


def make_checkpoint(root: Path) -> dict:
    """Save the benchmark Llama as a PaddleFormers flex checkpoint; return its facts."""
    import paddle.distributed as dist

    C.quiet_logs()
    model = C.build_llama(seed=0)
    ckpt = root / "checkpoint-1"
    dist.save_state_dict(model.sharded_state_dict(), str(ckpt / "model_state"))
    config = dict(C.LLAMA_KWARGS, architectures=["LlamaForCausalLM"])
    (root / "config.json").write_text(json.dumps(config))
    sizes = [int(p.numel()) * p.element_size() for p in model.parameters()]
    return {"model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "tensors": len(sizes),
            "checkpoint_files": C.tree_bytes(ckpt / "model_state")}


def child(variant: str, root: Path, out: Path) -> dict:
    C.quiet_logs()
    ckpt, config = root / "checkpoint-1", root / "config.json"
    result = {"variant": variant}
    writer_stats = []
    if variant.startswith("convert"):  # convert_before: the same, the package from PYTHONPATH (the other tree)
        from paddle_fullparam_callbacks.convert.convert import convert

        import paddleformers.transformers  # noqa: F401  (imported before the baseline, as in a user's process)

        workers = 2 if variant == "convert_workers2" else 1
        if workers == 1:
            writer_stats = C.record_writer_stats()
            module = sys.modules[convert.__module__]
            export_conversion = module.export_conversion

            def at_export(*args, **kwargs):  # the RSS when the export starts: what the preparation added
                result["rss_at_export"] = _status_kb()
                result["export_started_s"] = time.perf_counter()
                return export_conversion(*args, **kwargs)

            module.export_conversion = at_export

        def run():
            return convert(ckpt, out, model_config=config, workers=workers)
    elif variant == "raw_copy":
        files = sorted((ckpt / "model_state").glob("*.distcp"))

        def run():  # the kernel copies (copy_file_range: no user-space buffer), then one fsync
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "raw.bin", "wb") as dst:
                for f in files:
                    with open(f, "rb") as src:
                        left = os.fstat(src.fileno()).st_size
                        while left > 0:
                            n = os.copy_file_range(src.fileno(), dst.fileno(), left)
                            if n <= 0:
                                raise OSError(f"copy_file_range stopped with {left} bytes left")
                            left -= n
                os.fsync(dst.fileno())
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    gc.collect()
    C.trim_heap()
    with StatusSampler() as s, C.CpuShare() as share:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        info = run()
        seconds = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    result.update(seconds=seconds, rss_baseline=s.baseline, rss_peak=s.peak, rss_extra=s.extra(),
                  written=C.tree_bytes(out), cpu=share.as_dict(), minor_faults=faults)
    if "export_started_s" in result:
        result["prepare_s"] = result.pop("export_started_s") - t0
        result["rss_extra_at_export"] = {k: v - s.baseline.get(k, 0) for k, v in result.pop("rss_at_export").items()}
    if writer_stats:
        result["writer"] = writer_stats[-1]
    if info is not None:
        result.update(snapshot=str(info.path), timings=dict(info.timings), num_tensors=info.num_tensors)
    return result


def _before(tree: str, runs: dict) -> dict:
    """The other tree's convert, in the same rounds: its seconds and RSS, paired with the same raw copies."""
    before, raw = runs["convert_before"], runs["raw_copy"]
    return {"tree": str(Path(tree).resolve()),
            "seconds": C.median([r["seconds"] for r in before]),
            "all_seconds": [r["seconds"] for r in before],
            "median_paired_ratio_vs_raw_copy": round(C.median([a["seconds"] / b["seconds"] for a, b in zip(raw, before)]), 3),
            "median_paired_ratio_export_vs_raw_copy": round(C.median([a["seconds"] / b["timings"]["total_s"]
                                                                      for a, b in zip(raw, before)]), 3),
            "peak_extra_rss_bytes": {k: max(r["rss_extra"][k] for r in before) for k in ("VmRSS", "RssAnon", "RssFile")},
            "prepare_s": [round(r["prepare_s"], 3) for r in before],
            "all_paired_ratio_after_vs_before": [round(b["seconds"] / a["seconds"], 3)
                                                 for a, b in zip(runs["convert"], before)]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--root")
    ap.add_argument("--out")
    ap.add_argument("--make")
    ap.add_argument("--before", help="a checkout of another tree: its convert runs in the same rounds")
    ns = ap.parse_args()
    if ns.make:
        print(json.dumps(make_checkpoint(Path(ns.make))))
        return
    if ns.before:
        ns.before = str(C.existing_tree(ns.before))
    if ns.variant:
        print(json.dumps(child(ns.variant, Path(ns.root), Path(ns.out))))
        return

    work = Path(tempfile.mkdtemp(prefix="pfc_bench_convert_"))
    try:
        facts = C.run_child([__file__, "--make", str(work / "src")])
        cache = work / "descriptions"  # convert's model descriptions: kept by one untimed conversion first
        C.run_child([__file__, "--variant", "convert", "--root", str(work / "src"), "--out", str(work / "warm")],
                    env=dict(os.environ, PADDLE_FULLPARAM_CACHE_DIR=str(cache)))
        shutil.rmtree(work / "warm", ignore_errors=True)
        variants = VARIANTS + (("convert_before",) if ns.before else ())
        runs = {v: [] for v in variants}
        quiet = []
        for rep in range(ns.reps):
            for v in variants:
                out = work / f"out-{v}-{rep}"
                os.sync()
                quiet.append(C.wait_quiet(180))
                cold = work / f"descriptions-{v}-{rep}"  # empty: the first conversion of the model
                env = dict(os.environ, PADDLE_FULLPARAM_CACHE_DIR=str(cold if v != "convert" else cache))
                if v == "convert_before":
                    env["PYTHONPATH"] = str(Path(ns.before).resolve())
                r = C.run_child([__file__, "--variant", "convert" if v in ("convert_before", "convert_cold") else v,
                                 "--root", str(work / "src"), "--out", str(out)], env=env)
                r["loadavg"] = os.getloadavg()
                runs[v].append(r)
                shutil.rmtree(out, ignore_errors=True)
                extra = r["rss_extra"]
                print(f"rep {rep} {v:>17}: {r['seconds']:.2f} s, extra VmRSS {extra['VmRSS'] / 1e6:.0f} MB "
                      f"(anon {extra['RssAnon'] / 1e6:.0f}, file {extra['RssFile'] / 1e6:.0f})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    model_bytes, largest = facts["model_bytes"], facts["largest_tensor_bytes"]
    checkpoint_bytes = sum(facts["checkpoint_files"].values())
    bound = 0.1 * model_bytes + largest
    med = {v: C.median([r["seconds"] for r in runs[v]]) for v in VARIANTS}
    peak = {k: max(r["rss_extra"][k] for r in runs["convert"]) for k in ("VmRSS", "RssAnon", "RssFile")}
    result = {
        "benchmark": "convert",
        "checkpoint": {"format": "PaddleFormers flex (model_state/0.metadata + 0_0.distcp)", **facts},
        "repetitions": ns.reps,
        "seconds": med,
        "all_seconds": {v: [r["seconds"] for r in runs[v]] for v in VARIANTS},
        "raw_copy_gb_s": facts["model_bytes"] / 1e9 / med["raw_copy"],
        "convert_gb_s": facts["model_bytes"] / 1e9 / med["convert"],
        "ratio_vs_raw_copy": med["raw_copy"] / med["convert"],
        "all_paired_ratio_vs_raw_copy": [round(a["seconds"] / b["seconds"], 3)
                                         for a, b in zip(runs["raw_copy"], runs["convert"])],
        "median_paired_ratio_vs_raw_copy": round(C.median([a["seconds"] / b["seconds"]
                                                           for a, b in zip(runs["raw_copy"], runs["convert"])]), 3),
        "target_speed": "median_paired_ratio_vs_raw_copy >= 0.8",
        # the same pairs, convert's export alone (timings total_s: plan, read, write, commit; no preparation)
        "median_paired_ratio_export_vs_raw_copy": round(C.median([
            a["seconds"] / b["timings"]["total_s"] for a, b in zip(runs["raw_copy"], runs["convert"])]), 3),
        "foreign_cpu_fraction": {v: [r["cpu"]["foreign_fraction"] for r in runs[v]] for v in VARIANTS},
        "quiet_checks": {"busy_runs": sum(not q["quiet"] for q in quiet),
                         "max_waited_s": max(q["waited_s"] for q in quiet)},
        "ratio_workers2_vs_raw_copy": med["raw_copy"] / med["convert_workers2"],
        # the first conversion of the model on a machine (no description kept yet: the model class imported)
        "median_paired_ratio_cold_vs_raw_copy": round(C.median([a["seconds"] / b["seconds"] for a, b in
                                                                zip(runs["raw_copy"], runs["convert_cold"])]), 3),
        "peak_extra_rss_ratio_cold": round(max(r["rss_extra"]["VmRSS"] for r in runs["convert_cold"])
                                           / sum(facts["checkpoint_files"].values()), 4),
        "prepare_s_cold": [round(r["prepare_s"], 3) for r in runs["convert_cold"]],
        "loadavg_1min": {v: [round(r["loadavg"][0], 2) for r in runs[v]] for v in variants},
        "peak_extra_rss_bytes": peak,
        "peak_extra_rss_bound_bytes": bound,
        "target": "peak extra RSS (VmRSS) <= 0.1 x model bytes + largest tensor",
        "target_met": peak["VmRSS"] <= bound,
        "checkpoint_bytes": checkpoint_bytes,
        "peak_extra_rss_ratio": round(peak["VmRSS"] / checkpoint_bytes, 4),
        "target_rss": "peak_extra_rss_ratio (peak extra VmRSS / checkpoint bytes) <= 0.05",
        "target_rss_met": peak["VmRSS"] <= 0.05 * checkpoint_bytes,
        # what the preparation (index, model class import, lazy model) holds when the export starts, of that peak
        "extra_rss_at_export_bytes": {k: max(r["rss_extra_at_export"][k] for r in runs["convert"])
                                      for k in ("VmRSS", "RssAnon", "RssFile")},
        "minor_faults": {v: [r["minor_faults"] for r in runs[v]] for v in VARIANTS},
        "prepare_s": [round(r["prepare_s"], 3) for r in runs["convert"]],
        "timings_convert": runs["convert"][-1].get("timings"),
        "writer_convert": runs["convert"][-1].get("writer"),
        "before": _before(ns.before, runs) if ns.before else None,
        "machine": C.machine_info(),
        "commit": C.git_commit(),
        "date": C.now_iso(),
    }
    C.write_json(RESULT_PATH, result)
    print(json.dumps({k: result[k] for k in ("seconds", "ratio_vs_raw_copy", "median_paired_ratio_vs_raw_copy",
                                             "peak_extra_rss_bytes", "peak_extra_rss_ratio", "target_rss_met",
                                             "peak_extra_rss_bound_bytes", "target_met")}, indent=1))


if __name__ == "__main__":
    main()
