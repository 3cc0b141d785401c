"""FP8 snapshots against bfloat16 ones of the same model: time, bytes, peak extra host memory; one process and 4 ranks.

Run (about 6 minutes; waits for the machine to be idle before each child)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/export_fp8.py                         # 5 paired repetitions -> bench/results/export_fp8.json
    $PY bench/export_fp8.py --reps 3 --regimes tmpfs --parts single

The model is ``export_single.py``'s ~673 MB float32 PaddleFormers Llama (hidden 1024, intermediate 2816,
8 layers, vocab 32000: 56 Linear weights, 411 MB, whose dimensions are multiples of 128). Two variants,
both ``export.dtype=bfloat16`` (float32 parameters: the writer casts):

* ``bf16``: the bfloat16 snapshot;
* ``fp8``: the same with ``export.quantization=fp8`` (blocks of 128 x 128): the 56 weights as e4m3 bytes
  and float32 scales, the rest bfloat16.

``single``: each repetition runs both variants, in turn (the order alternating), each in a fresh process
after waiting for idle CPUs (a run during which other processes used more than 20% of the CPUs is repeated,
up to 3 tries, the least disturbed kept, as ``export_single.py`` does) (``ExportSession.export`` timed, all of it: planning, assembly, casts,
quantization, BLAKE3, writes, fsync, commit), with ``export_single.py``'s RSS sampler: peak extra RSS over
the RSS right before the export. ``ranks``: one ``paddle.distributed.launch`` of 4 CPU ranks (dp4: every
rank a replica, the files split across them, as ``export_ranks.py``), both variants alternating after one
untimed warm-up each; a repetition's time is the slowest rank's. Regimes: ``tmpfs`` (/dev/shm: the CPU
sets the pace) and ``disk`` (/tmp).

Reported per regime: median seconds, ``time_ratio`` = fp8 s / bf16 s (ratio of the medians and the median
of the paired per-repetition ratios), snapshot bytes and ``quantized_bytes_ratio`` = the quantized
weights' bytes in the FP8 snapshot (e4m3 bytes and scales) / the same weights' bytes in the bfloat16 one,
peak extra RSS (single) and the writer's ``peak_pending_bytes``. A ``facts`` child times the arithmetic
alone on one thread: ``Fp8Weight`` on the model's transposed Linear shapes (its scales, its bytes) against
the bfloat16 cast of the same weight (``CastArray``), in ns per element.

Targets (issue 40): ``time_ratio <= 1.15``, ``quantized_bytes_ratio <= 0.55``, the FP8 export's peak extra
host memory within the same budget as the bfloat16 one's (``export.max_pending_bytes``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "export_fp8.json"
REGIMES = {"tmpfs": "/dev/shm", "disk": "/tmp"}
VARIANTS = ("bf16", "fp8")
NPROC = 4
MAX_SHARD = C.tiny("40MB", "100KB")  # 4 ranks: a few files each
TARGETS = {"time_ratio": "<= 1.15", "quantized_bytes_ratio": "<= 0.55",
           "peak_extra_rss": "fp8's within the writer's budget (export.max_pending_bytes: 512MB), as bf16's"}


def overrides(variant: str, out: Path, shard: str) -> list:
    base = [f"output_dir={out}", f"export.max_shard_size={shard}", "export.dtype=bfloat16", "export.timeout_s=600"]
    return base + (["export.quantization=fp8"] if variant == "fp8" else [])


def snapshot_bytes(path: Path) -> dict:
    """Tensor bytes of the snapshot: all, and those of the quantized weights (e4m3 bytes and their scales) or,
    in a bfloat16 snapshot, of the weights an FP8 one quantizes."""
    from paddle_fullparam_callbacks.export.write.header import read_header
    from paddle_fullparam_callbacks.models.mappings.fp8 import DECLARATIONS

    pattern = DECLARATIONS["LlamaForCausalLM"].pattern
    total = quantized = 0
    for f in sorted(path.glob("*.safetensors")):
        _, entries, _ = read_header(f)
        for name, e in entries.items():
            n = e.end - e.begin
            total += n
            weight = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
            quantized += n if pattern.fullmatch(weight) else 0
    return {"tensor_bytes": total, "quantized_part_bytes": quantized}


# ---- one process -------------------------------------------------------------------------------------
def child(variant: str, out: Path) -> dict:
    if variant == "facts":
        return facts()
    C.quiet_logs()
    model = C.build_llama(seed=0)
    writer_stats = C.record_writer_stats()
    info, seconds, rss, cpu, _ = C.timed_export(model, overrides(variant, out, "5GB"))
    return {"variant": variant, "seconds": seconds, "peak_extra_rss": rss.extra, "rss_samples": rss.samples,
            "peak_pending_bytes": info.peak_pending_bytes, "model_bytes": C.parameter_bytes(model),
            "cpu": cpu.as_dict(), "timings": dict(info.timings), "writer_stats": writer_stats[-1] if writer_stats else {},
            **snapshot_bytes(info.path)}


def facts() -> dict:
    """ns per element of the arithmetic alone, one thread, on the model's Linear shapes (transposed views)."""
    import numpy as np

    from paddle_fullparam_callbacks.host.copy import row_blocks
    from paddle_fullparam_callbacks.host.lazy import CastArray
    from paddle_fullparam_callbacks.host.pool import WorkerPool, using
    from paddle_fullparam_callbacks.host.quantize import Fp8Weight

    h, i = C.LLAMA_KWARGS["hidden_size"], C.LLAMA_KWARGS["intermediate_size"]
    out = {}

    def timed(fn, n, reps=C.tiny(5, 1)):
        return C.best_ns_per_element(fn, n, reps, digits=2)

    def fill(lazy):
        buf = np.empty(lazy.shape, lazy.dtype)
        for r0, r1 in row_blocks(lazy, 2 * 2**20):
            lazy.rows(r0, r1).fill(buf[r0:r1])

    with using(WorkerPool(1)):
        for shape in ((h, h), (h, i), (i, h)):  # Paddle [in, out]; the snapshot holds the transpose
            w = (np.random.default_rng(1).standard_normal(shape) * 0.02).astype(np.float32).T
            cast = CastArray(w, "float32", "bfloat16", np.dtype(np.uint16))
            q = Fp8Weight(cast, "bfloat16", (128, 128))
            out[f"hf{list(w.shape)}"] = {"bf16_cast_ns": timed(lambda: fill(cast), w.size),
                                         "fp8_scales_ns": timed(lambda: Fp8Weight(cast, "bfloat16", (128, 128)), w.size),
                                         "fp8_bytes_ns": timed(lambda: fill(q.weight), w.size)}
    return {"variant": "facts", "one_thread_ns_per_element": out}


def run_single(regimes, reps: int, quiet_wait: float) -> dict:
    facts_result = C.run_child([__file__, "--variant", "facts", "--out", "/tmp"])
    runs = {(g, v): [] for g in regimes for v in VARIANTS}
    for rep in range(reps):
        for regime in regimes:
            for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                r = C.least_disturbed_child(lambda out: [__file__, "--variant", v, "--out", str(out)],
                                            f"pfc-bench-fp8-{v}-", REGIMES[regime], quiet_wait)
                runs[(regime, v)].append(r)
                print(f"single rep {rep + 1}/{reps} {regime:>5} {v:>4}: {r['seconds']:6.3f} s, "
                      f"{r['tensor_bytes'] / 1e6:7.1f} MB, peak extra RSS {r['peak_extra_rss'] / 2**20:6.1f} MiB, "
                      f"others used {r['cpu']['foreign_fraction']:.0%} of the CPUs", flush=True)
    out = {"facts": {k: v for k, v in facts_result.items() if k not in ("variant", "process_seconds")}, "regimes": {}}
    for regime in regimes:
        rr = {v: runs[(regime, v)] for v in VARIANTS}
        res = summary(rr)
        res["peak_extra_rss_bytes"] = {v: int(C.median([r["peak_extra_rss"] for r in rs])) for v, rs in rr.items()}
        res["peak_pending_bytes"] = {v: int(C.median([r["peak_pending_bytes"] for r in rs])) for v, rs in rr.items()}
        res["foreign_cpu_fraction"] = {v: [r["cpu"]["foreign_fraction"] for r in rs] for v, rs in rr.items()}
        res["writer_fill_s"] = {v: round(C.median([r["writer_stats"].get("fill_s", 0) for r in rs]), 4) for v, rs in rr.items()}
        out["regimes"][regime] = res
    return out


def summary(rr: dict) -> dict:
    """Seconds and bytes of the two variants, their ratios."""
    sec = {v: round(C.median([r["seconds"] for r in rs]), 4) for v, rs in rr.items()}
    paired = [round(f["seconds"] / b["seconds"], 3) for b, f in zip(rr["bf16"], rr["fp8"])]
    first = {v: rs[0] for v, rs in rr.items()}
    return {"seconds": sec, "all_seconds": {v: [round(r["seconds"], 4) for r in rs] for v, rs in rr.items()},
            "time_ratio": round(sec["fp8"] / sec["bf16"], 3), "all_time_ratio": paired,
            "median_paired_time_ratio": round(C.median(paired), 3),
            "tensor_bytes": {v: r["tensor_bytes"] for v, r in first.items()},
            "quantized_part_bytes": {v: r["quantized_part_bytes"] for v, r in first.items()},
            "bytes_ratio": round(first["fp8"]["tensor_bytes"] / first["bf16"]["tensor_bytes"], 4),
            "quantized_bytes_ratio": round(first["fp8"]["quantized_part_bytes"] / first["bf16"]["quantized_part_bytes"], 4)}


# ---- four ranks --------------------------------------------------------------------------------------
def rank_main(args) -> None:
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    import harness
    import paddle.distributed as dist

    harness.init_fleet(dp=NPROC)
    rank = dist.get_rank()
    C.quiet_logs()
    model = C.build_llama(seed=0)
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source
    from paddle_fullparam_callbacks.trainer.topology import build_context

    ctx = build_context(None)
    report = {"rank": rank, "regimes": {}}
    step = 0
    for regime in args.regimes.split(","):
        base = Path(REGIMES[regime]) / f"pfc-bench-fp8-{args.tag}"
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()
        sessions = {}
        for v in VARIANTS:
            cfg = load_config(None, overrides(v, base / v, MAX_SHARD))
            s = ExportSession(cfg, base / v, ctx=ctx)
            s.start()
            sessions[v] = (s, build_model_source(model, cfg))
        entry = {"reps": []}
        for rep in range(-1, args.reps):  # rep -1: an untimed warm-up of each
            for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                session, source = sessions[v]
                if rank == 0:
                    os.sync()
                dist.barrier()
                step += 1
                with C.CpuShare() as cpu:
                    t0 = time.perf_counter()
                    info = session.export(source, step=step)
                    seconds = time.perf_counter() - t0
                if rep >= 0:
                    row = {"rep": rep, "variant": v, "seconds": round(seconds, 4),
                           "peak_pending_bytes": info.peak_pending_bytes, "machine_cpu_s": round(cpu.machine, 3),
                           "own_cpu_s": round(cpu.own, 3)}
                    if rank == 0:
                        row.update(snapshot_bytes(info.path))
                    entry["reps"].append(row)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(base / v / f"hf-step-{step:06d}", ignore_errors=True)
                dist.barrier()
        for s, _ in sessions.values():
            s.close()
        report["regimes"][regime] = entry
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    print("FP8RANKS " + json.dumps(report), flush=True)
    dist.barrier()


def run_ranks(regimes, reps: int, timeout: float) -> dict:
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    import harness

    quiet = C.wait_quiet(120)
    log_dir = tempfile.mkdtemp(prefix="pfc_bench_fp8_")
    res = harness.run_launch(Path(__file__), ["--rank-mode", "--tag", str(os.getpid()), "--reps", reps,
                                              "--regimes", ",".join(regimes)], nproc=NPROC, log_dir=log_dir,
                             timeout=timeout)
    tagged = dict(res.tagged("FP8RANKS"))
    if res.rc != 0 or res.timed_out or len(tagged) != NPROC:
        raise RuntimeError("export_fp8 launch failed:\n" + res.describe())
    out = {"launch_seconds": round(res.seconds, 1), "quiet_before_launch": quiet, "regimes": {}}
    for regime in regimes:
        rr = {}
        for v in VARIANTS:
            rows = []
            for rep in range(reps):
                per_rank = {r: next(x for x in d["regimes"][regime]["reps"] if x["rep"] == rep and x["variant"] == v)
                            for r, d in tagged.items()}
                first = per_rank[min(per_rank)]
                wall = max(x["seconds"] for x in per_rank.values())
                # others' CPU while the ranks ran: the machine's busy CPU (rank 0's window) minus the ranks' own
                foreign = max(0.0, first["machine_cpu_s"] - sum(x["own_cpu_s"] for x in per_rank.values()))
                rows.append({"seconds": wall, "foreign_cpu_fraction": round(foreign / (wall * (os.cpu_count() or 1)), 3),
                             "tensor_bytes": first["tensor_bytes"], "quantized_part_bytes": first["quantized_part_bytes"],
                             "peak_pending_bytes": max(x["peak_pending_bytes"] for x in per_rank.values())})
            rr[v] = rows
        res_ = summary(rr)
        res_["foreign_cpu_fraction"] = {v: [r["foreign_cpu_fraction"] for r in rs] for v, rs in rr.items()}
        res_["peak_pending_bytes"] = {v: int(C.median([r["peak_pending_bytes"] for r in rs])) for v, rs in rr.items()}
        out["regimes"][regime] = res_
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS + ("facts",), help="(child) run one variant, print its JSON")
    ap.add_argument("--out", type=Path, help="(child) directory to write into")
    ap.add_argument("--rank-mode", action="store_true", help="(launched) run as one rank")
    ap.add_argument("--tag", default="x", help="(launched) directory tag shared by the ranks")
    ap.add_argument("--reps", type=int, default=C.tiny(5, 1))
    ap.add_argument("--regimes", default=C.tiny("tmpfs,disk", "tmpfs"))
    ap.add_argument("--parts", default="single,ranks", help="comma-separated subset of single,ranks")
    ap.add_argument("--quiet-wait", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args.variant, args.out)), flush=True)
        return 0
    if args.rank_mode:
        rank_main(args)
        return 0
    regimes = [g for g in args.regimes.split(",") if g]
    parts = [p for p in args.parts.split(",") if p]
    out = {"benchmark": "export_fp8", "model": {"class": "paddleformers LlamaForCausalLM", "dtype": "float32",
                                                 "config": C.LLAMA_KWARGS},
           "variants": {v: overrides(v, Path("OUT"), "5GB")[2:] for v in VARIANTS}, "repetitions": args.reps,
           "regime_dirs": {g: REGIMES[g] for g in regimes}, "targets": TARGETS}
    if "single" in parts:
        out["single"] = run_single(regimes, args.reps, args.quiet_wait)
    if "ranks" in parts:
        out["ranks"] = {"ranks": NPROC, "topology": "dp4", "max_shard_size": MAX_SHARD,
                        **run_ranks(regimes, args.reps, args.timeout)}
    met = {}
    for part in ("single", "ranks"):
        for regime, r in out.get(part, {}).get("regimes", {}).items():
            met[f"time_ratio.{part}.{regime}"] = r["median_paired_time_ratio"] <= 1.15
            met[f"quantized_bytes_ratio.{part}.{regime}"] = r["quantized_bytes_ratio"] <= 0.55
            if part == "single":
                budget = 512 * 2**20
                met[f"peak_extra_rss.{part}.{regime}"] = r["peak_extra_rss_bytes"]["fp8"] <= budget
    out["met"] = met
    C.write_result(args.result, out)
    for part in ("single", "ranks"):
        for regime, r in out.get(part, {}).get("regimes", {}).items():
            print(f"[{part} {regime}] bf16 {r['seconds']['bf16']:.3f} s, fp8 {r['seconds']['fp8']:.3f} s: time ratio "
                  f"{r['time_ratio']} (paired median {r['median_paired_time_ratio']}, {r['all_time_ratio']}); bytes "
                  f"{r['bytes_ratio']}, quantized part {r['quantized_bytes_ratio']}")
    for k, ok in met.items():
        print(f"target {k}: {'met' if ok else 'MISSED'}")
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
