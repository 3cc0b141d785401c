"""Many writers: 4 ranks (dp4, each rank its own files) exporting at once, against 4 raw writers.

Run (about 3 minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/export_ranks.py                 # 5 repetitions -> bench/results/export_ranks.json
    $PY bench/export_ranks.py --reps 5 --regimes tmpfs

One ``paddle.distributed.launch`` of this file (``--rank-mode``) with 4 CPU ranks (gloo; the test
harness's ``init_fleet(dp=4)`` with its gloo-safe group creation, wrapped in ``run_launch`` with
a timeout). Every rank builds the same ~673 MB float32 Llama of ``export_single.py`` (a replica:
dp4), and ``ExportSession`` with ``build_context()`` splits the snapshot's files across the four
replicas (``export.max_shard_size=40MB``: 18 files, balanced by bytes): each rank assembles its
files locally and writes them, then the coordinator commits (status exchange, index, manifest).

Variants, in each regime (tmpfs: /dev/shm; disk: /tmp on /dev/vda), after one untimed warm-up
of each (the first export's one-time costs are ``export_single.py``'s subject), alternating order
per repetition, each started on every rank at a barrier, with ``os.sync()`` and a barrier between:

* ``ours``: ``session.export(source, step)``, all of it (planning check, assembly, transposes,
  BLAKE3, writes, fsync, status exchange, commit);
* ``raw``: each rank writes the same number of bytes into the same number of files (the sizes of
  its files in ``ours``), plain ``f.write`` of the parameters' bytes, then ``os.fsync`` per file.

Aggregate GB/s of a repetition = bytes of all ranks / the slowest rank's seconds; reported as
medians over repetitions, with ``ratio_vs_raw`` = raw aggregate s / ours aggregate s (and the
median of each repetition's paired ratio). Each repetition also records the share of the CPUs
other processes used meanwhile (``foreign_cpu_fraction``: the machine's busy CPU seconds minus
the four ranks' own, over wall x CPUs; kernel writeback of the ranks' pages counts as other). Each rank's
``WriterStats`` and session timings of ``ours`` are kept. Four ranks share 2 cores here, so both
variants are CPU-bound in the tmpfs regime: the ratio says how much CPU ours spends per byte
beside the raw copy, not how a cluster node would fare (see ``scaling_model`` in the JSON and the
README's "Scaling model").
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

RESULT_PATH = C.RESULTS_DIR / "export_ranks.json"
REGIMES = {"tmpfs": "/dev/shm", "disk": "/tmp"}
NPROC = 4
MAX_SHARD = C.tiny("40MB", "100KB")  # tiny mode (bench/_common.py): still a few files for every rank


# ---- rank side -------------------------------------------------------------------------------------
def _raw_sources(model):
    """Flat byte views of the parameters (contiguous), cycled to fill any byte count."""
    return [memoryview(a).cast("B") for a in C.parameter_arrays(model) if a.nbytes]


def _write_raw(directory: Path, rank: int, sizes, sources) -> int:
    src_i, pos, total = 0, 0, 0
    for i, size in enumerate(sizes):
        with open(directory / f"raw-{rank}-{i}.bin", "wb") as f:
            left = size
            while left:
                mv = sources[src_i]
                n = min(left, len(mv) - pos)
                f.write(mv[pos:pos + n])
                left -= n
                pos += n
                if pos == len(mv):
                    src_i, pos = (src_i + 1) % len(sources), 0
            f.flush()
            os.fsync(f.fileno())
        total += size
    return total


def rank_main(args) -> None:
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    import harness
    import paddle.distributed as dist

    hcg = harness.init_fleet(dp=NPROC)
    rank = dist.get_rank()
    C.quiet_logs()
    model = C.build_llama(seed=0)
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source
    from paddle_fullparam_callbacks.trainer.topology import build_context

    writer_stats = C.record_writer_stats()
    ctx = build_context(None)
    sources = _raw_sources(model)
    report = {"rank": rank, "dp": hcg.get_data_parallel_world_size(), "regimes": {}}
    step = 0
    for regime in args.regimes.split(","):
        base = Path(REGIMES[regime]) / f"pfc-bench-ranks-{args.tag}"
        out = base / "snapshots"
        raw_dir = base / "raw"
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            raw_dir.mkdir(parents=True)
        dist.barrier()
        cfg = load_config(None, [f"output_dir={out}", f"export.max_shard_size={MAX_SHARD}", "export.timeout_s=600"])
        session = ExportSession(cfg, out, ctx=ctx)
        session.start()
        source = build_model_source(model, cfg)
        p = session.prepare(source)
        mine = p.writes.files_of_rank(rank)
        sizes = [p.plan.files[i].total_bytes for i in mine]
        entry = {"files": len(mine), "bytes": sum(sizes), "reps": [], "writer_stats": [], "timings": []}
        for rep in range(-1, args.reps):  # rep -1: one untimed warm-up of each (first-time costs of both)
            order = ("raw", "ours") if rep % 2 == 0 else ("ours", "raw")
            for variant in order:
                if rank == 0:
                    os.sync()
                dist.barrier()
                with C.CpuShare() as cpu:
                    t0 = time.perf_counter()
                    if variant == "ours":
                        step += 1
                        info = session.export(source, step=step)
                        written = sum(sizes)
                    else:
                        written = _write_raw(raw_dir, rank, sizes, sources)
                    seconds = time.perf_counter() - t0
                if rep >= 0:
                    entry["reps"].append({"rep": rep, "variant": variant, "seconds": round(seconds, 4), "bytes": written,
                                          "machine_cpu_s": round(cpu.machine, 3), "own_cpu_s": round(cpu.own, 3)})
                    if variant == "ours":
                        entry["timings"].append({k: round(v, 4) for k, v in info.timings.items()})
                        entry["writer_stats"].append(writer_stats[-1] if writer_stats and mine else {})
                dist.barrier()
                if rank == 0:  # outside the timed region: the next variant starts on an empty directory
                    shutil.rmtree(out / f"hf-step-{step:06d}", ignore_errors=True)
                for f in raw_dir.glob(f"raw-{rank}-*.bin"):
                    f.unlink()
                dist.barrier()
        session.close()
        report["regimes"][regime] = entry
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    print("EXPRANKS " + json.dumps(report), flush=True)
    dist.barrier()


# ---- the scaling model -----------------------------------------------------------------------------
GB = 1e9
FORMULA = ("T = t_plan + max(t_net, t_cpu, t_disk) + t_commit;  t_plan = tensors/1000 * plan_s_per_1000; "
           "t_net = max(inter_node_bytes_per_rank / link_inter, intra_node_bytes_per_rank / link_intra) "
           "(one assembly rate a for all traffic when measured on this machine); t_cpu = bytes_written_per_rank / "
           "writer_rate; t_disk = bytes_written_per_node / disk_rate_per_node. Assembly, writing and the disk "
           "stream side by side (bounded by export.max_pending_bytes), so the slowest of the three sets the time.")


ASSEMBLY_CASE = "mp2xpp2"  # bench/assembler.py's 4-rank case (its tiny run has it too)


def _sig(x: float) -> float:
    """Four significant figures: a tiny run's rates are small, and fixed decimals would round them to 0."""
    return float(f"{x:.4g}")


def _measured_inputs(ranks_out: dict) -> dict:
    """Per-rank figures measured on this machine, from the JSONs of bench/assembler.py and bench/export_single.py
    (a missing file or figure stops the benchmark: the model never falls back to figures of its own)."""
    need = lambda name, *keys: C.read_input(name, *keys, made_by=f"bench/{name.split('.')[0]}.py")  # noqa: E731
    case = need("assembler.json", "assembly", "cases", ASSEMBLY_CASE)
    inp = {"assembly_case": f"{ASSEMBLY_CASE} ({case['ranks']} ranks, routed and Paddle's full_param)",
           "assembly_gb_s_per_rank": {}}
    for name, variant in (("routed", "routed"), ("paddle_full_param", "paddle")):
        at = ("assembly", "cases", ASSEMBLY_CASE, "variants", variant)
        per_rank, seconds = need("assembler.json", *at, "per_rank"), need("assembler.json", *at, "median_seconds")
        # a rank's rate: what it received (the kernel's count, its sockets) over the slowest rank's time
        received = max(need("assembler.json", *at, "per_rank", r, "kernel_received") for r in per_rank)
        inp["assembly_gb_s_per_rank"][name] = _sig(received / GB / seconds)
    pl = need("assembler.json", "planner")
    inp["plan_s_per_1000_tensors"] = _sig(pl["plan_50k_seconds"] / pl["tensors"] * 1000)
    inp["replan_s_per_1000_tensors"] = _sig(pl["replan_50k_seconds"] / pl["tensors"] * 1000)
    rate = lambda regime, variant: need("export_single.json", "regimes", regime, "throughput_gb_s", variant)  # noqa: E731
    inp["writer_gb_s_per_process_cpu_bound"] = rate("tmpfs", "ours")
    inp["raw_page_cache_gb_s_per_process"] = rate("tmpfs", "raw")
    inp["disk_raw_gb_s"] = rate("disk", "raw")
    inp["paddleformers_save_gb_s_per_process"] = rate("disk", "paddleformers")
    for regime, r in ranks_out.get("regimes", {}).items():
        inp[f"dp4_aggregate_gb_s_{regime}"] = {v: r["variants"][v]["aggregate_gb_s"] for v in ("ours", "raw")}
    return inp


def _predict(cfg: dict, rates: dict) -> dict:
    """Seconds of each term and the total for one topology and one set of rates (each rate > 0, or one error)."""
    zero = sorted(k for k, v in rates.items() if k != "commit" and not v > 0)
    if zero:
        raise SystemExit(f"bench/export_ranks.py: the scaling model's rates {zero} are not positive: {rates}")
    t = {"t_plan": cfg["tensors"] / 1000 * rates["plan_s_per_1000"]}
    if rates.get("link_inter"):
        t["t_net"] = max(cfg["inter_bytes"] / rates["link_inter"], cfg["intra_bytes"] / rates["link_intra"])
    else:
        t["t_net"] = (cfg["inter_bytes"] + cfg["intra_bytes"]) / rates["assembly"]
    t["t_cpu"] = cfg["write_bytes_rank"] / rates["writer"]
    t["t_disk"] = cfg["write_bytes_node"] / rates["disk_node"]
    t["t_commit"] = rates.get("commit", 0.5)
    t = {k: round(v, 2) for k, v in t.items()}
    t["total_s"] = round(t["t_plan"] + max(t["t_net"], t["t_cpu"], t["t_disk"]) + t["t_commit"], 1)
    t["set_by"] = {"t_net": "network", "t_cpu": "CPU", "t_disk": "disk"}[max(("t_net", "t_cpu", "t_disk"), key=t.get)]
    return t


def _routed_bytes(dp: int, pp: int, mp: int, per_node: int) -> dict:
    """The most bytes one rank receives inside its node and across nodes for Llama-2-70B in bfloat16 (5GB files)."""
    from paddle_fullparam_callbacks.plan.model_shapes import preset
    from paddle_fullparam_callbacks.plan.prediction import predict
    from paddle_fullparam_callbacks.plan.topology import plan_topology

    topo = plan_topology([("data", dp), ("pipe", pp), ("sharding", 1), ("sep", 1), ("expert", 1), ("model", mp)])
    shapes, dtype = preset("Llama-2-70B")
    ranks = predict(shapes, "bfloat16", topo, 5 * 10**9, {r: r // per_node for r in range(topo.world_size)})["ranks"]
    across = max(t.get("received_cross_node", 0) for t in ranks.values())
    inside = max(t.get("received", 0) - t.get("received_cross_node", 0) for t in ranks.values())
    return {"inter_bytes": float(across), "intra_bytes": float(inside)}


def build_scaling_model(ranks_out: dict) -> dict:
    B = 70e9 * 2  # 70B parameters, bfloat16
    tensors = 80 * 9 + 3  # Llama-2-70B: 80 layers x (q, k, v, o, gate, up, down, 2 norms) + embeddings, norm, head
    nodes, per_node, ranks = 8, 8, 64
    w_rank = B / ranks
    topo = {
        # ours (the routed schedule, the default): the most any rank receives inside its node and across nodes,
        # as `paddle-fullparam plan --model Llama-2-70B` predicts it (each byte a writer lacks, once)
        "ours_mp8xpp8": _routed_bytes(1, 8, 8, per_node),
        "ours_dp8xmp8": _routed_bytes(8, 1, 8, per_node),
        # PaddleFormers save_pretrained(flex_checkpoint): full_param over the whole world (one group:
        # an all_gather of every tensor through all 64 ranks, across nodes, replicas included: each
        # rank's NIC carries about B), then savers i % 64 == rank write round-robin (safetensors.save_file)
        "paddleformers_any": {"inter_bytes": B * 63 / 64, "intra_bytes": 0.0},
    }
    for c in topo.values():
        c.update(tensors=tensors, write_bytes_rank=w_rank, write_bytes_node=w_rank * per_node)
    m = _measured_inputs(ranks_out)
    here = {"plan_s_per_1000": m["plan_s_per_1000_tensors"], "assembly": m["assembly_gb_s_per_rank"]["routed"] * GB,
            "writer": m["writer_gb_s_per_process_cpu_bound"] * GB, "disk_node": m["disk_raw_gb_s"] * GB}
    here_pf = dict(here, assembly=m["assembly_gb_s_per_rank"]["paddle_full_param"] * GB,
                   writer=m["paddleformers_save_gb_s_per_process"] * GB)
    clusters = {
        "100Gb/s links, 2 NVMe per node": {"link_inter": 12.5 * GB, "link_intra": 100 * GB, "disk_node": 6 * GB},
        "400Gb/s links, 4 NVMe per node": {"link_inter": 50 * GB, "link_intra": 100 * GB, "disk_node": 12 * GB},
    }
    pred = {"this machine's per-rank figures (CPU, gloo, 2 cores per 'node', its disk)": {
        "ours_mp8xpp8": _predict(topo["ours_mp8xpp8"], here),
        "ours_dp8xmp8": _predict(topo["ours_dp8xmp8"], here),
        "paddleformers_mp8xpp8_or_dp8xmp8": _predict(topo["paddleformers_any"], here_pf)}}
    for name, c in clusters.items():
        ours = dict(here, **c)
        pf = dict(here_pf, **c)
        pred[name] = {"ours_mp8xpp8": _predict(topo["ours_mp8xpp8"], ours),
                      "ours_dp8xmp8": _predict(topo["ours_dp8xmp8"], ours),
                      "paddleformers_mp8xpp8_or_dp8xmp8": _predict(topo["paddleformers_any"], pf)}
    return {
        "model": "70B parameters, bfloat16 (140 GB), Llama-2-70B shapes: 723 tensors",
        "ranks": ranks, "nodes": nodes, "ranks_per_node": per_node, "formula": FORMULA,
        "bytes": {k: {kk: round(vv / GB, 2) for kk, vv in v.items() if kk.endswith("bytes") or kk.startswith("write")}
                  for k, v in topo.items()},
        "measured_inputs": m,
        "cluster_assumptions": {k: {kk: round(vv / GB, 1) for kk, vv in v.items()} for k, v in clusters.items()},
        "cluster_notes": "link_inter: one NIC per GPU (GB/s); link_intra: NVLink broadcast bandwidth per GPU, "
                         "conservative; disk_node: local NVMe write GB/s per node (8 ranks); the writer's CPU rate "
                         "per rank is this machine's single-process rate (2 cores), on a node with 8+ cores per rank "
                         "it is the same or better. PaddleFormers keeps its measured per-process write rate "
                         "(full_param + safetensors.save_file) and full_param's assembly rate.",
        "predictions_s": pred,
    }


def print_scaling_model(sm: dict) -> None:
    print(f"\nscaling model: {sm['model']} on {sm['ranks']} ranks ({sm['nodes']} nodes)")
    for setting, rows in sm["predictions_s"].items():
        print(f"  {setting}:")
        for name, t in rows.items():
            print(f"    {name:34s} {t['total_s']:7.1f} s (net {t['t_net']}, cpu {t['t_cpu']}, disk {t['t_disk']}; "
                  f"set by {t['set_by']})")


# ---- parent side -----------------------------------------------------------------------------------
def summarize(per_rank: dict, regimes, reps: int) -> dict:
    out = {}
    for regime in regimes:
        ranks = {r: d["regimes"][regime] for r, d in per_rank.items()}
        total = sum(e["bytes"] for e in ranks.values())
        res = {"bytes_total": total, "bytes_per_rank": {r: e["bytes"] for r, e in ranks.items()},
               "files_per_rank": {r: e["files"] for r, e in ranks.items()}, "variants": {}}
        for variant in ("raw", "ours"):
            per_rep = []
            for rep in range(reps):
                rows = {r: next(x for x in e["reps"] if x["rep"] == rep and x["variant"] == variant) for r, e in ranks.items()}
                secs = {r: x["seconds"] for r, x in rows.items()}
                wall = max(secs.values())
                # others' CPU while the ranks ran: the machine's busy CPU (rank 0's window) minus the ranks' own
                foreign = max(0.0, rows[0]["machine_cpu_s"] - sum(x["own_cpu_s"] for x in rows.values()))
                per_rep.append({"max_seconds": wall, "per_rank_seconds": secs,
                                "aggregate_gb_s": round(total / 1e9 / wall, 3),
                                "foreign_cpu_fraction": round(foreign / (wall * (os.cpu_count() or 1)), 3)})
            med = C.median([x["max_seconds"] for x in per_rep])
            per_rank_gbs = {r: round(C.median([ranks[r]["bytes"] / 1e9 / x["per_rank_seconds"][r] for x in per_rep]), 3)
                            for r in ranks}
            res["variants"][variant] = {"median_max_seconds": round(med, 4),
                                        "aggregate_gb_s": round(total / 1e9 / med, 3),
                                        "median_per_rank_gb_s": per_rank_gbs, "reps": per_rep}
        res["ratio_vs_raw"] = round(res["variants"]["raw"]["median_max_seconds"] / res["variants"]["ours"]["median_max_seconds"], 3)
        res["all_ratio_vs_raw"] = [round(a["max_seconds"] / b["max_seconds"], 3)
                                   for a, b in zip(res["variants"]["raw"]["reps"], res["variants"]["ours"]["reps"])]
        res["median_paired_ratio_vs_raw"] = round(C.median(res["all_ratio_vs_raw"]), 3)
        res["all_foreign_cpu_fraction"] = {v: [x["foreign_cpu_fraction"] for x in res["variants"][v]["reps"]]
                                           for v in ("raw", "ours")}
        keys = sorted({k for e in ranks.values() for s in e["writer_stats"] for k in s})
        res["ours_writer_stats_median_over_reps"] = {
            r: {k: round(C.median([s.get(k, 0) for s in e["writer_stats"]]), 4) for k in keys} for r, e in ranks.items()}
        t_keys = sorted({k for e in ranks.values() for t in e["timings"] for k in t})
        res["ours_session_timings_median_over_reps"] = {
            r: {k: round(C.median([t.get(k, 0) for t in e["timings"]]), 4) for k in t_keys} for r, e in ranks.items()}
        out[regime] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank-mode", action="store_true", help="(launched) run as one rank")
    ap.add_argument("--tag", default="x", help="(launched) directory tag shared by the ranks")
    ap.add_argument("--reps", type=int, default=C.tiny(5, 1))
    ap.add_argument("--regimes", default="tmpfs,disk")
    ap.add_argument("--model-only", action="store_true",
                    help="only the scaling model, from the recorded JSON (--result) and the other benchmarks' JSONs")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    args = ap.parse_args(argv)
    if args.rank_mode:
        rank_main(args)
        return 0
    regimes = [g for g in args.regimes.split(",") if g]
    bad = [g for g in regimes if g not in REGIMES]
    if bad:
        ap.error(f"unknown regime(s) {bad}")
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    import harness

    _measured_inputs({})  # the scaling model's inputs, checked before the launch: a missing one stops the run here
    if args.model_only:  # the scaling model again, from this benchmark's recorded JSON and today's inputs
        out = C.read_input(args.result.name, made_by="bench/export_ranks.py") if args.result.parent == C.RESULTS_DIR \
            else json.loads(args.result.read_text())
        out["scaling_model"] = build_scaling_model(out)
        out["scaling_model"]["recomputed"] = f"--model-only on {C.now_iso()} (the dp4 runs are the recorded ones)"
        C.write_json(args.result, out)
        print_scaling_model(out["scaling_model"])
        return 0
    quiet = C.wait_quiet(120)
    log_dir = tempfile.mkdtemp(prefix="pfc_bench_ranks_")
    tag = f"{os.getpid()}"
    res = harness.run_launch(Path(__file__), ["--rank-mode", "--tag", tag, "--reps", args.reps, "--regimes", ",".join(regimes)],
                             nproc=NPROC, log_dir=log_dir, timeout=args.timeout)
    tagged = res.tagged("EXPRANKS")
    if res.rc != 0 or res.timed_out or len(tagged) != NPROC:
        raise RuntimeError("export_ranks launch failed:\n" + res.describe())
    per_rank = {rank: d for rank, d in tagged}
    regimes_out = summarize(per_rank, regimes, args.reps)
    out = {
        "benchmark": "export_ranks",
        "ranks": NPROC, "topology": "dp4 (each rank a mesh of one; files split across the replicas)",
        "model": {"class": "paddleformers LlamaForCausalLM", "dtype": "float32", "config": C.LLAMA_KWARGS},
        "max_shard_size": MAX_SHARD, "repetitions": args.reps, "regime_dirs": {g: REGIMES[g] for g in regimes},
        "regimes": regimes_out,
        "launch_seconds": round(res.seconds, 1), "log_dir": log_dir, "quiet_before_launch": quiet,
        "raw_call": "per rank, per file of its ours files: open(wb); f.write(parameter bytes) up to the file's size; "
                    "f.flush(); os.fsync",
    }
    out["scaling_model"] = build_scaling_model(out)
    C.write_result(args.result, out)
    for regime, r in regimes_out.items():
        v = r["variants"]
        print(f"[{regime}] {r['bytes_total'] / 1e9:.3f} GB over {NPROC} ranks: raw {v['raw']['aggregate_gb_s']} GB/s, "
              f"ours {v['ours']['aggregate_gb_s']} GB/s, ratio_vs_raw {r['ratio_vs_raw']} (per rep {r['all_ratio_vs_raw']}; "
              f"others' CPU share {r['all_foreign_cpu_fraction']})")
    print_scaling_model(out["scaling_model"])
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
