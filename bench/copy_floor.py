"""An export against the copy floor: ``cp -r`` of the same snapshot plus fsync, and a ``pwrite`` loop of its
bytes held ready in memory, on the machine's disk, at two model sizes.

Run (about 10 minutes; waits for idle CPUs before each child)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/copy_floor.py                       # 3 interleaved repetitions -> bench/results/copy_floor.json
    $PY bench/copy_floor.py --sizes 0.67GB --reps 5
    git worktree add --detach /tmp/before <commit> && $PY bench/copy_floor.py --sizes 2.75GB --before /tmp/before

With ``--before TREE``, ``ours_before`` (that tree's package: its process's ``PYTHONPATH``) runs in the same rounds
as ``ours``: a regression between two trees is told apart from the disk's moods (``ratio_vs_before``).

Models: PaddleFormers Llamas in float32, built with ``paddle.seed(0)``: ``0.67GB`` is the single-process
benchmarks' (hidden 1024, 8 layers, vocab 32000); ``2.75GB`` has hidden 2048, intermediate 5504, 11 layers,
16 heads, vocab 32000 (2,751 MB of parameters, 1,866 MB of them Linear weights the HF layout transposes).
Variants, each in a fresh process, interleaved, directories on /tmp (the machine's disk, ext4 on /dev/vda):

* ``ours``: ``ExportSession.export`` (what the callback runs at a save) with ``export.max_shard_size=5GB`` and
  the defaults (``export.threads: auto``): mapping, transposes, BLAKE3 of every byte, ``pwrite``, fsync,
  index, config, manifest, the atomic rename;
* ``cp``: ``cp -r`` of a snapshot the export wrote before (its pages in the page cache, as a model's bytes
  are in memory for ``ours``), then ``fsync`` of every file and of the directory: what a user compares with;
* ``pwrite``: the snapshot's files read into memory before timing, then each written by a loop of
  ``os.pwrite`` of 16 MB pieces and ``fsync``ed: the floor of writing ready bytes.

Before each run the parent calls ``sync`` (no dirty pages of the last one) and waits for idle CPUs; each
child records the share of the CPUs others used meanwhile. ``ratio_vs_cp`` = cp s / ours s (the paired
median of per-repetition ratios beside the ratio of medians). Target: ``ratio_vs_cp`` >= 0.8 at 2.75 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "copy_floor.json"
SIZES = {
    "0.67GB": dict(C.LLAMA_KWARGS),
    "2.75GB": dict(C.LLAMA_KWARGS, hidden_size=C.tiny(2048, 128), intermediate_size=C.tiny(5504, 352),
                   num_hidden_layers=C.tiny(11, 3), num_attention_heads=16, num_key_value_heads=16),
}
TINY_SIZES = "2.75GB"  # the tiny mode (bench/_common.py): the size the target is judged at, once
VARIANTS = ("ours", "cp", "pwrite")
PIECE = 16 * 2**20
DISK = "/tmp"


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _export(size: str, out: Path, threads: str = "auto"):
    """Build the model and export it into ``out`` (returns seconds, info, writer stats, CPU share)."""
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    C.quiet_logs()
    paddle.set_device("cpu")
    paddle.seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    model.eval()
    stats = C.record_writer_stats()
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=5GB", f"export.threads={threads}"])
    session = ExportSession(cfg, out)
    session.start()
    source = build_model_source(model, cfg)
    C.trim_heap()
    with C.CpuShare() as share:
        t0 = time.perf_counter()
        info = session.export(source, step=1)
        seconds = time.perf_counter() - t0
    session.close()
    return seconds, info, (stats[-1] if stats else {}), share.as_dict(), C.parameter_bytes(model)


def child(variant: str, size: str, out: Path, src: Path) -> dict:
    if variant == "prepare":  # the snapshot cp and pwrite copy (untimed)
        seconds, info, _, _, model_bytes = _export(size, out)
        return {"variant": variant, "path": str(info.path), "model_bytes": model_bytes, "seconds": seconds}
    if variant == "ours":
        seconds, info, stats, share, model_bytes = _export(size, out)
        return {"variant": variant, "seconds": seconds, "bytes": info.bytes, "timings": dict(info.timings),
                "writer_stats": stats, "cpu": share, "model_bytes": model_bytes}
    files = sorted(p for p in src.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    if variant == "cp":
        dst = out / src.name
        out.mkdir(parents=True, exist_ok=True)
        with C.CpuShare() as share:
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
            _fsync_tree(dst)
            seconds = time.perf_counter() - t0
        return {"variant": variant, "seconds": seconds, "bytes": total, "cpu": share.as_dict()}
    if variant == "pwrite":
        import numpy as np

        ready = [(p.relative_to(src), np.fromfile(p, dtype=np.uint8)) for p in files]  # in memory before timing
        with C.CpuShare() as share:
            t0 = time.perf_counter()
            for rel, data in ready:
                target = out / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    mv = memoryview(data)
                    for i in range(0, len(mv), PIECE):
                        os.pwrite(fd, mv[i:i + PIECE], i)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _fsync_tree(out)
            seconds = time.perf_counter() - t0
        return {"variant": variant, "seconds": seconds, "bytes": total, "cpu": share.as_dict()}
    raise SystemExit(f"unknown variant {variant!r}")


def run_all(sizes, reps: int, result_path: Path, before=None, quiet_wait: float = 120.0) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pfc-copyfloor-", dir=DISK))
    res = {"benchmark": "copy_floor", "disk": DISK, "repetitions": reps, "sizes": {}, "quiet_checks": [],
           "before_tree": str(before) if before else None}
    variants = VARIANTS + (("ours_before",) if before else ())
    try:
        for size in sizes:
            prep = C.run_child([__file__, "--variant", "prepare", "--size", size, "--out", str(work / f"src-{size}")])
            src = Path(prep["path"])
            runs = {v: [] for v in variants}
            for rep in range(reps):
                # the order reversed every other round: a variant run first in each round pays for the previous
                # round's writeback (measured: the first of a pair ran 1.2-1.7x slower, whichever tree it was)
                for v in (variants if rep % 2 == 0 else variants[::-1]):
                    out = work / f"out-{size}-{v}"
                    os.sync()
                    q = C.wait_quiet(quiet_wait)
                    res["quiet_checks"].append(q)
                    env = dict(os.environ, PYTHONPATH=str(before)) if v == "ours_before" else None
                    try:
                        r = C.run_child([__file__, "--variant", v.replace("_before", ""), "--size", size, "--out",
                                         str(out), "--src", str(src)], env=env)
                    finally:
                        shutil.rmtree(out, ignore_errors=True)
                    r["quiet"], r["loadavg"] = q, os.getloadavg()
                    runs[v].append(r)
                    print(f"{size} rep {rep + 1}/{reps} {v:>7}: {r['seconds']:6.3f} s ({r['bytes'] / 1e9 / r['seconds']:.2f} "
                          f"GB/s), others used {r['cpu']['foreign_fraction']:.0%} of the CPUs", flush=True)
            sec = {v: C.median([r["seconds"] for r in rs]) for v, rs in runs.items()}
            paired = [round(c["seconds"] / o["seconds"], 3) for c, o in zip(runs["cp"], runs["ours"])]
            paired_pw = [round(c["seconds"] / o["seconds"], 3) for c, o in zip(runs["pwrite"], runs["ours"])]
            w = runs["ours"]
            res["sizes"][size] = {
                "model_bytes": prep["model_bytes"], "snapshot_bytes": runs["ours"][0]["bytes"],
                "seconds": {v: round(s, 4) for v, s in sec.items()},
                "all_seconds": {v: [round(r["seconds"], 4) for r in rs] for v, rs in runs.items()},
                "gb_s": {v: round(runs[v][0]["bytes"] / 1e9 / s, 3) for v, s in sec.items()},
                "ratio_vs_cp": round(sec["cp"] / sec["ours"], 3), "all_ratio_vs_cp": paired,
                "median_paired_ratio_vs_cp": round(C.median(paired), 3),
                "ratio_vs_pwrite": round(sec["pwrite"] / sec["ours"], 3), "all_ratio_vs_pwrite": paired_pw,
                "median_paired_ratio_vs_pwrite": round(C.median(paired_pw), 3),
                "ours_timings_median": {k: round(C.median([r["timings"].get(k, 0) for r in w]), 4) for k in w[0]["timings"]},
                "ours_writer_median": {k: round(C.median([r["writer_stats"].get(k, 0) for r in w]), 4)
                                       for k in sorted({k for r in w for k in r["writer_stats"]})},
                "foreign_cpu_fraction": {v: [r["cpu"]["foreign_fraction"] for r in rs] for v, rs in runs.items()},
                "loadavg_1min": {v: [round(r["loadavg"][0], 2) for r in rs] for v, rs in runs.items()},
            }
            if before:
                b = runs["ours_before"]
                pb = [round(c["seconds"] / o["seconds"], 3) for c, o in zip(runs["cp"], b)]
                res["sizes"][size].update(
                    before_median_paired_ratio_vs_cp=round(C.median(pb), 3), before_all_ratio_vs_cp=pb,
                    ratio_vs_before=[round(o["seconds"] / x["seconds"], 3) for o, x in zip(runs["ours"], b)],
                    before_writer_median={k: round(C.median([r["writer_stats"].get(k, 0) for r in b]), 4)
                                          for k in sorted({k for r in b for k in r["writer_stats"]})})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    big = res["sizes"].get("2.75GB")
    res["target"] = "ratio_vs_cp >= 0.8 at 2.75 GB (paired median)"
    res["met"] = None if big is None else big["median_paired_ratio_vs_cp"] >= 0.8
    qs = res.pop("quiet_checks")
    res["quiet_checks"] = {"busy_runs": sum(not q["quiet"] for q in qs), "max_waited_s": max(q["waited_s"] for q in qs)}
    C.write_result(result_path, res)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS + ("prepare",))
    ap.add_argument("--size", choices=tuple(SIZES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--src", type=Path)
    ap.add_argument("--sizes", default=C.tiny(",".join(SIZES), TINY_SIZES))
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    ap.add_argument("--before", help="a checkout of another tree: its export runs in the same rounds (ours_before)")
    ap.add_argument("--quiet-wait", type=float, default=120.0, help="at most this long to wait for idle CPUs per child")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args.variant, args.size, args.out, args.src)), flush=True)
        return 0
    before = C.existing_tree(args.before) if args.before else None
    res = run_all([s for s in args.sizes.split(",") if s], max(1, args.reps), args.result, before, args.quiet_wait)
    for size, r in res["sizes"].items():
        print(f"{size}: " + ", ".join(f"{v} {s:.3f} s" for v, s in r["seconds"].items()) +
              f"; ours / cp = {r['median_paired_ratio_vs_cp']} (paired), ours / pwrite = {r['median_paired_ratio_vs_pwrite']}")
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
