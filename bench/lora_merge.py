"""The cost of merging LoRA at export: a LoRA model's merged snapshot against the plain export of the
same base model, single process, on a fast "disk" (tmpfs) and on the real disk.

Run (about 3 minutes; waits for the machine to be idle before each child)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/lora_merge.py                  # 3 interleaved repetitions -> bench/results/lora_merge.json
    $PY bench/lora_merge.py --reps 5 --regimes tmpfs
    git worktree add --detach /tmp/before <commit> && $PY bench/lora_merge.py --before /tmp/before

With ``--before TREE`` every variant also runs with that tree's package (``<variant>_before``, its process's
``PYTHONPATH`` the tree), in the same rounds: paired ratios, before against after, on one machine state.

The model is ``export_single.py``'s ~673 MB float32 PaddleFormers Llama (8 layers, hidden 1024,
vocab 32000, untied head; ``_common.build_llama(seed=0)``). Variants, each in its own fresh process:

* ``plain``: ``ExportSession.export`` of the base model (what ``export_single.py`` calls ``ours``);
* ``merged``: the same base wrapped in PaddleFormers' ``LoRAModel`` with r=16, alpha=32 on all 56
  linear layers (q/k/v/o, gate/up/down), every ``lora_B`` nonzero (seeded): the default
  ``export.lora: merge`` writes ``W + s * A @ B`` for each of them, merged in the assembler;
* ``merged_adapter``: ``merged`` plus ``export.peft_adapter=inside`` (the adapter's 28 MB too).

Both write the same snapshot bytes (the same tensor names and shapes); the LoRA model's own
``lora_A``/``lora_B`` exist before the timed region and are not counted as extra memory. Per run:
seconds, peak extra RSS (sampled every 2 ms against the baseline right before the export), the
writer's pending-bytes peak. Targets: ``merged`` within 1.15 x ``plain``'s median time, and its peak
extra RSS within the plain export's budget (``export.max_pending_bytes``, 512 MB by default).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

VARIANTS = ("plain", "merged", "merged_adapter")
REGIMES = {"tmpfs": "/dev/shm", "disk": "/tmp"}
RANK, ALPHA = 16, 32
TARGETS = {"time_ratio_merged_vs_plain": "<= 1.15", "peak_extra_rss.merged": "<= export.max_pending_bytes (512 MB)"}
RESULT_PATH = C.RESULTS_DIR / "lora_merge.json"


def _lora(model):
    import numpy as np
    import paddle
    from paddleformers.peft import LoRAConfig, LoRAModel

    lm = LoRAModel(model, LoRAConfig(target_modules=[r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"],
                                     r=RANK, lora_alpha=ALPHA))
    rng = np.random.default_rng(0)
    with paddle.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("lora_B"):
                p.set_value(paddle.to_tensor((0.01 * rng.standard_normal(p.shape)).astype("float32")))
    return lm


def child(variant: str, out: Path) -> dict:
    C.quiet_logs()
    model = C.build_llama(seed=0)
    model_bytes = C.parameter_bytes(model)
    if variant != "plain":
        model = _lora(model)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"output_dir={out}", "export.max_shard_size=5GB"]
    if variant == "merged_adapter":
        overrides.append("export.peft_adapter=inside")
    stats = C.record_writer_stats()
    info, seconds, s, cpu, cfg = C.timed_export(model, overrides)
    return {"variant": variant, "model_bytes": model_bytes, "seconds": seconds, "snapshot_bytes": info.bytes,
            "timings": dict(info.timings), "peak_pending_bytes": info.peak_pending_bytes,
            "peak_extra_rss": s.extra, "rss_baseline": s.baseline, "cpu": cpu.as_dict(),
            "budget": cfg.export.max_pending, "written": C.tree_bytes(info.path),
            "writer": {k: v for k, v in (stats[-1] if stats else {}).items() if isinstance(v, (int, float))}}


def run_all(reps: int, regimes, variants, result_path: Path, quiet_wait: float, before=None) -> dict:
    if before:
        variants = [x for v in variants for x in (v, v + "_before")]
    runs = {(g, v): [] for g in regimes for v in variants}
    for rep in range(reps):
        for regime in regimes:
            for v in variants:
                tmp = Path(tempfile.mkdtemp(prefix=f"pfc-lora-{v}-", dir=REGIMES[regime]))
                os.sync()
                q = C.wait_quiet(quiet_wait)
                env = dict(os.environ, PYTHONPATH=str(Path(before).resolve())) if v.endswith("_before") else None
                try:
                    r = C.run_child([__file__, "--variant", v.replace("_before", ""), "--out", str(tmp / "out")],
                                    env=env)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                    os.sync()
                r["quiet"], r["loadavg"] = q, os.getloadavg()
                runs[(regime, v)].append(r)
                print(f"rep {rep + 1}/{reps} {regime:>5} {v:>14}: {r['seconds']:6.3f} s, peak extra RSS "
                      f"{r['peak_extra_rss'] / 2**20:7.1f} MiB, others used {r['cpu']['foreign_fraction']:.0%} "
                      "of the CPUs", flush=True)
    first = next(iter(runs.values()))[0]
    out = {"benchmark": "lora_merge", "model": {"class": "paddleformers LlamaForCausalLM", "dtype": "float32",
                                                "config": C.LLAMA_KWARGS},
           "lora": {"r": RANK, "lora_alpha": ALPHA, "targets": "q/k/v/o, gate/up/down (56 layers)"},
           "model_bytes": first["model_bytes"], "budget_bytes": first["budget"], "repetitions": reps,
           "regime_dirs": {g: REGIMES[g] for g in regimes}, "regimes": {}, "targets": TARGETS, "met": {},
           "before_tree": str(before) if before else None}
    for regime in regimes:
        rr = {v: runs[(regime, v)] for v in variants}
        sec = {v: C.median([r["seconds"] for r in rs]) for v, rs in rr.items()}
        res = {"seconds": {v: round(s, 4) for v, s in sec.items()},
               "all_seconds": {v: [round(r["seconds"], 4) for r in rs] for v, rs in rr.items()},
               "peak_extra_rss_bytes": {v: int(C.median([r["peak_extra_rss"] for r in rs])) for v, rs in rr.items()},
               "all_peak_extra_rss_bytes": {v: [r["peak_extra_rss"] for r in rs] for v, rs in rr.items()},
               "peak_pending_bytes": {v: int(C.median([r["peak_pending_bytes"] for r in rs])) for v, rs in rr.items()},
               "snapshot_bytes": {v: rs[0]["snapshot_bytes"] for v, rs in rr.items()},
               "timings_median": {v: {k: round(C.median([r["timings"][k] for r in rs if k in r["timings"]]), 4)
                                      for k in rs[0]["timings"]} for v, rs in rr.items()},
               "foreign_cpu_fraction": {v: [r["cpu"]["foreign_fraction"] for r in rs] for v, rs in rr.items()},
               "loadavg_1min": {v: [round(r["loadavg"][0], 2) for r in rs] for v, rs in rr.items()},
               # the export's own CPU seconds (all its threads): what a busy machine's wall times hide
               "own_cpu_s": {v: [r["cpu"]["own_cpu_s"] for r in rs] for v, rs in rr.items()},
               "own_cpu_s_median": {v: round(C.median([r["cpu"]["own_cpu_s"] for r in rs]), 3) for v, rs in rr.items()},
               "writer_threads_s": {v: {k: round(C.median([r["writer"].get(k, 0.0) for r in rs]), 4)
                                        for k in ("copy_s", "fill_s", "hash_s", "write_s", "fsync_s", "pool_wait_s",
                                                  "put_wait_s") if any(k in r["writer"] for r in rs)}
                                    for v, rs in rr.items()}}
        for v in sec:  # each variant against the plain export of its own tree, paired in each round
            base = "plain_before" if v.endswith("_before") else "plain"
            if v != base and base in sec:
                res[f"paired_ratio_{v}_vs_{base}"] = round(C.median([a["seconds"] / b["seconds"]
                                                                     for a, b in zip(rr[v], rr[base])]), 3)
        if "plain" in sec:
            for v in sec:
                if v != "plain":
                    res[f"time_ratio_{v}_vs_plain"] = round(sec[v] / sec["plain"], 3)
                    res[f"all_paired_ratio_{v}_vs_plain"] = [round(a["seconds"] / b["seconds"], 3)
                                                             for a, b in zip(rr[v], rr["plain"])]
            if "merged" in sec:
                out["met"][f"time_ratio.{regime}"] = res["time_ratio_merged_vs_plain"] <= 1.15
                out["met"][f"paired_time_ratio.{regime}"] = res["paired_ratio_merged_vs_plain"] <= 1.15
        if "merged" in sec:
            out["met"][f"peak_extra_rss.{regime}"] = res["peak_extra_rss_bytes"]["merged"] <= first["budget"]
        out["regimes"][regime] = res
    C.write_result(result_path, out)
    return out


def print_table(res: dict) -> None:
    print(f"\nmodel_bytes = {res['model_bytes']} ({res['model_bytes'] / 1e9:.3f} GB), LoRA r={RANK} on 56 layers, "
          f"{res['repetitions']} interleaved repetitions (medians)")
    for regime, r in res["regimes"].items():
        print(f"\n[{regime}]\n{'variant':>15} {'seconds':>8} {'peak extra RSS':>15}")
        for v, s in r["seconds"].items():
            print(f"{v:>15} {s:8.3f} {r['peak_extra_rss_bytes'][v] / 2**20:11.1f} MiB")
        for k, val in r.items():
            if k.startswith("time_ratio"):
                print(f"{k} = {val}")
    for k, ok in res["met"].items():
        print(f"target {k}: {'met' if ok else 'MISSED'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, help="(child) run one variant and print its JSON result")
    ap.add_argument("--out", type=Path, help="(child) directory to write into")
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1), help="interleaved repetitions (default 3)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    # tiny mode (bench/_common.py): the regimes differ in the folder only
    ap.add_argument("--regimes", default=C.tiny(",".join(REGIMES), "tmpfs"))
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="at most this long to wait for idle CPUs per child")
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    ap.add_argument("--before", help="a checkout of another tree: each variant also runs with its package")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args.variant, args.out)), flush=True)
        return 0
    if args.before:
        args.before = C.existing_tree(args.before)
    res = run_all(max(1, args.reps), [g for g in args.regimes.split(",") if g],
                  [v for v in args.variants.split(",") if v], args.result, args.quiet_wait, args.before)
    print_table(res)
    print(f"\nwrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
