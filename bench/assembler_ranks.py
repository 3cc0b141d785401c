"""Launched part of ``bench/assembler.py`` (one rank of an mp2 x pp2 CPU/gloo job).

    python -m paddle.distributed.launch --nproc_per_node 4 bench/assembler_ranks.py \
        [--cases small,large] [--reps 3] [--profile-dir DIR]

Not meant to be run by hand: ``bench/assembler.py`` launches it (through the test harness's
``run_launch``, with a timeout) and reads the ``ASMBENCH {json}`` lines each rank prints.

On every rank: ``harness.init_fleet(mp=2, pp=2)`` (the gloo-safe group creation), then for each
case a synthetic sharded state dict (see ``build_state_dict``) and, per repetition, the variants
``paddle`` (Paddle 3.3.1's ``full_param`` HV path), ``builtin`` (this package's MeshAssembler,
keep = every target, metadata exchange and planning included in the timed region) and
``builtin_keep_own`` (same, keep = a quarter of the targets), and ``builtin_bucket8MB`` /
``builtin_bucket128MB`` (keep = all, with a larger ``bucket_bytes`` than the default
``topology.bucket_bytes`` = 2MB; large case only), interleaved and rotated, each between two barriers. Before the timed repetitions one untimed warm-up pass per variant checks, on rank 0,
that ``paddle`` and ``builtin`` yield bit-identical tensors (sha256 of every tensor's bytes) and
that they match the values the state dict was built from.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "multirank"))

import numpy as np  # noqa: E402

import harness  # noqa: E402

CASES = {
    # name: (number of tensors, global square side)
    "small": (2000, 64),
    "large": (64, 1024),
}
VARIANTS = ("paddle", "builtin", "builtin_keep_own", "builtin_bucket8MB", "builtin_bucket128MB")
# what ExportSession passes on a 4-rank mesh: the topology config's default bucket
from paddle_fullparam_callbacks.config import TopologyConfig  # noqa: E402

DEFAULT_BUCKET = TopologyConfig().bucket_for(4)


def global_values(i: int, n: int) -> np.ndarray:
    """The full [n, n] float32 tensor number i (exact integers < 2**24, position dependent)."""
    idx = np.arange(n * n, dtype=np.int64)
    return ((idx * 2654435761 + i * 40503) % 1000003).astype(np.float32).reshape(n, n)


def tensor_name(i: int) -> str:
    return f"model.layers.{i // 2}.w{i % 2}.{i:05d}.weight"


def build_state_dict(case: str, hcg):
    """This rank's ShardedWeights: tensor i lives on pipe stage i % 2; tensors with (i // 2) even
    are column-sharded over mp ([n, n/2] halves), the others replicated over mp."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    count, n = CASES[case]
    stage, mp_rank, mp = hcg.get_stage_id(), hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
    sd = {}
    for i in range(count):
        if i % 2 != stage:
            continue
        g = global_values(i, n)
        name = tensor_name(i)
        if (i // 2) % 2 == 0:
            w = n // mp
            local = np.ascontiguousarray(g[:, mp_rank * w:(mp_rank + 1) * w])
            sd[name] = ShardedWeight(name, paddle.to_tensor(local), (n, w), (n, n), (0, mp_rank * w))
        else:
            sd[name] = ShardedWeight(name, paddle.to_tensor(g), (n, n), (n, n), (0, 0))
    return sd


def sha(t) -> str:
    return hashlib.sha256(np.ascontiguousarray(t.numpy()).tobytes()).hexdigest()


# ---- the variants --------------------------------------------------------------------------------
def run_paddle(sd, hcg, ctx, sink=None):
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param

    t0 = time.perf_counter()
    n = 0
    for name, t in full_param(sd, aoa_config={}, h_group=hcg.get_model_parallel_group(),
                              v_group=hcg.get_pipe_parallel_group()):
        n += 1
        if sink is not None:
            sink[name] = sha(t)
    return {"seconds": time.perf_counter() - t0, "yielded": n}


def run_builtin(sd, hcg, ctx, sink=None, keep_own=False, bucket_bytes=None):
    from paddle_fullparam_callbacks.assemble.mapping import build_destination_map
    from paddle_fullparam_callbacks.assemble.mesh import MeshAssembler, records_from_state_dict, shard_info_from_records

    t0 = time.perf_counter()
    records = [r for per_rank in ctx.mesh_gather_object(records_from_state_dict(ctx.rank, sd)) for r in per_rank]
    t1 = time.perf_counter()
    dmap = build_destination_map(shard_info_from_records(records), {})
    t2 = time.perf_counter()
    targets = sorted(dmap.names)
    if keep_own:
        pos, size = ctx.mesh.ranks.index(ctx.rank), ctx.mesh.size
        q = -(-len(targets) // size)
        keep = targets[pos * q:(pos + 1) * q]
    else:
        keep = targets
    asm = MeshAssembler(sd, records, dmap, targets, keep, ctx.mesh, ctx.rank, ctx.h_group, ctx.v_group, "keep",
                        bucket_bytes)
    t3 = time.perf_counter()
    n = 0
    for name, t in asm.run():
        n += 1
        if sink is not None:
            sink[name] = sha(t)
    t4 = time.perf_counter()
    if asm.errors:
        raise RuntimeError(asm.errors[0])
    return {"seconds": t4 - t0, "run_seconds": t4 - t3, "gather_seconds": t1 - t0, "dmap_seconds": t2 - t1,
            "asm_init_seconds": t3 - t2, "yielded": n, "kept": len(keep), "targets": len(targets),
            "collectives": asm.collectives, "rounds": len(asm.rounds),
            "gather_rounds": sum(r.kind == "gather" for r in asm.rounds),
            "bcast_rounds": sum(r.kind == "bcast" for r in asm.rounds), "items": len(asm.items),
            "bytes_moved": asm.bytes_moved}


def call_variant(variant, sd, hcg, ctx, sink=None, bucket_bytes=DEFAULT_BUCKET):
    """``builtin_bucket<N>MB``: the builtin assembler with ``bucket_bytes = N MiB`` (keep = all)."""
    if variant == "paddle":
        return run_paddle(sd, hcg, ctx, sink)
    m = re.fullmatch(r"builtin_bucket(\d+)MB", variant)
    if m:
        bucket_bytes = int(m.group(1)) * 2**20
    r = run_builtin(sd, hcg, ctx, sink, keep_own=(variant == "builtin_keep_own"), bucket_bytes=bucket_bytes)
    r["bucket_bytes"] = bucket_bytes
    return r


def counting_collectives(fn):
    """Run fn() counting paddle.distributed.broadcast / all_gather / all_gather_object calls
    (Paddle's full_param calls them through the ``paddle.distributed`` attributes)."""
    import paddle.distributed as dist

    counts = {"broadcast": 0, "all_gather": 0, "all_gather_object": 0}
    originals = {k: getattr(dist, k) for k in counts}

    def wrap(k):
        def f(*a, **kw):
            counts[k] += 1
            return originals[k](*a, **kw)
        return f

    for k in counts:
        setattr(dist, k, wrap(k))
    try:
        result = fn()
    finally:
        for k, v in originals.items():
            setattr(dist, k, v)
    return result, counts


def top_functions(prof: cProfile.Profile, n: int = 12) -> dict:
    import _common as C  # bench/ is on sys.path once main() ran

    st = pstats.Stats(prof, stream=io.StringIO())
    return {key: C.profile_top(st, key, n, digits=4) for key in ("cumulative", "tottime")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="small,large")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET,
                    help="MeshAssembler bucket of 'builtin' and 'builtin_keep_own' (default: topology.bucket_bytes)")
    ap.add_argument("--profile-dir", default="", help="one extra untimed pass of paddle and builtin per case under cProfile (rank 0's stats kept)")
    ns = ap.parse_args()

    import paddle
    import paddle.distributed as dist

    sys.path.insert(0, str(HERE))
    import _common as C

    C.quiet_logs()
    paddle.set_device("cpu")
    hcg = harness.init_fleet(mp=2, pp=2)
    from paddle_fullparam_callbacks.trainer.topology import build_context

    ctx = build_context()
    rank = dist.get_rank()
    variants = ns.variants.split(",")
    report = {"rank": rank, "mesh": [list(r) for r in ctx.mesh.rows], "cases": {}}

    all_variants = variants
    for case in ns.cases.split(","):
        # the bucket diagnostics only matter where slices are large (small: one round either way)
        variants = [v for v in all_variants if case == "large" or not v.startswith("builtin_bucket")]
        sd = build_state_dict(case, hcg)
        count, n = CASES[case]
        cres = {"tensors": count, "global_shape": [n, n], "local_entries": len(sd),
                "local_bytes": int(sum(int(sw.local_tensor.numel()) * 4 for sw in sd.values())),
                "global_bytes": count * n * n * 4, "reps": {v: [] for v in variants}}
        # warm-up + correctness (untimed for the headline; seconds kept for reference)
        sinks = {}
        for v in variants:
            sink = {} if v != "builtin_keep_own" else None
            dist.barrier()
            if v == "paddle":
                r, cres["paddle_collectives"] = counting_collectives(lambda sd=sd: call_variant(v, sd, hcg, ctx, sink))
            else:
                r = call_variant(v, sd, hcg, ctx, sink, ns.bucket_bytes)
            dist.barrier()
            cres.setdefault("warmup", {})[v] = r
            if sink is not None:
                sinks[v] = sink
        check = {}
        if "paddle" in sinks and "builtin" in sinks:
            a, b = sinks["paddle"], sinks["builtin"]
            expected = {tensor_name(i): hashlib.sha256(global_values(i, n).tobytes()).hexdigest() for i in range(count)}
            check = {"names_compared": len(set(a) & set(b)), "same_names": set(a) == set(b),
                     "bit_identical": set(a) == set(b) and all(a[k] == b[k] for k in a),
                     "method": "sha256 of every yielded tensor's bytes, paddle vs builtin (keep=all), and vs "
                               "the numpy global tensors the shards were cut from"}
            for v, got in sinks.items():
                check[f"{v}_matches_expected"] = got == expected
        cres["check"] = check
        del sinks
        # timed repetitions, interleaved, order rotated each repetition
        for rep in range(ns.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                gc.collect()
                dist.barrier()
                r = call_variant(v, sd, hcg, ctx, None, ns.bucket_bytes)
                dist.barrier()
                r["rep"] = rep
                cres["reps"][v].append(r)
        if ns.profile_dir:
            cres["profile"] = {}
            for v in [v for v in ("paddle", "builtin") if v in variants]:
                gc.collect()
                dist.barrier()
                prof = cProfile.Profile()
                prof.enable()
                call_variant(v, sd, hcg, ctx, None, ns.bucket_bytes)
                prof.disable()
                dist.barrier()
                if rank == 0:
                    os.makedirs(ns.profile_dir, exist_ok=True)
                    prof.dump_stats(os.path.join(ns.profile_dir, f"{case}-{v}.prof"))
                    cres["profile"][v] = top_functions(prof)
        report["cases"][case] = cres
        del sd
        gc.collect()
    dist.barrier()
    print("ASMBENCH " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
