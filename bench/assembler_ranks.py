"""Launched part of ``bench/assembler.py`` and ``bench/nodes_traffic.py``: one rank of one case.

    python -m paddle.distributed.launch --nproc_per_node 4 bench/assembler_ranks.py \
        --case mp2xpp2 --mp 2 --pp 2 [--dp 1] [--experts none|data|model] [--size small|full] \
        [--reps 3] [--variants paddle,seed,routed] [--max-shard-size 1MB] [--iface VETH]

Not meant to be run by hand: the orchestrators launch it (one launch per case) and read the
``ASMBENCH {json}`` line each rank prints.

On every rank: ``harness.init_fleet(dp, mp, pp)`` (the gloo-safe group creation), the harness's
``TinyParallelLlama`` at the size's dimensions (``--experts``: plus ``NUM_EXPERTS`` experts per decoder
layer held whole by their owner on that axis, as ``tests/multirank/ep_job.py`` builds them), its weights
set by ``harness.perturb(model, 1)`` (the values the tests check against), and ``build_context`` (the
export's own groups; ``expert_axes`` as the callback would read them from ``moe_group``).

The variants, each over the export's real code path minus the file writer:

* ``seed`` / ``routed``: ``planning.plan_export`` (the package's own planning: records exchange,
  ``DestinationMap``, and for routed ``plan_placement`` + ``plan_routes``) with ``topology.schedule``
  = seed / routed, once, untimed; then targets = the destinations of this mesh's files, keep = those of
  the files this rank writes (as ``ExportSession.export`` computes them), and the timed
  ``streaming.stream_tensors`` (the replica-digest exchange, then ``MeshAssembler`` resp.
  ``RoutedAssembler`` over ``ctx.pair_groups``, a ``PairGroups``), its ``traffic`` dict giving the
  assembler's own counts (``asm.stats``) and, for routed, the plan's prediction;
* ``paddle``: the same with ``assembler=paddle`` (Paddle's ``full_param`` HV path over the job's mp
  and pp groups, through the package's adapter; every rank of a mesh assembles every tensor, keeps its
  own); refused where the mesh is not Paddle's groups (experts over the data axis): recorded as not run.

Warm-up: one untimed pass per variant hashes (sha256 of ``np.ascontiguousarray(plain_array(t))``)
every tensor the rank keeps and compares it with the full tensor (``harness.expected_global`` of the
source, transposed as the AOA says); the orchestrator checks that each variant's kept names cover the
snapshot once. Then ``--reps`` repetitions, variants interleaved and rotated, each timed between a
barrier and the end of this rank's assembly. Around each: the kernel's TCP byte counts of this rank's
own pid (``ss -tinpH``: ``bytes_received`` and ``bytes_acked`` summed over its sockets, per socket
before/after) right before and right after the assembly, and once more after the closing barrier;
with ``--iface``, the interface's ``rx_bytes``/``tx_bytes`` (``/sys/class/net/IFACE/statistics``,
this rank's network namespace) after the opening barrier and after the closing one.

``PFC_BENCH_PROFILE=DIR`` in the environment: each timed repetition runs under cProfile, its stats in
``DIR/<variant>-rank<N>-rep<R>.prof`` (``python -m pstats``); the launch passes the variable to every rank.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "multirank"), str(HERE)]

import numpy as np  # noqa: E402

import harness  # noqa: E402

# Model dimensions per size (TinyParallelLlama, float32). "full" is the ~88 MiB model of
# CPU_CLUSTER.md's 2026-12-03 measurement; "small" runs each case in seconds; "tiny" (under 1 MiB) is the
# orchestrators' size in the tiny mode (PFC_BENCH_TINY=1, bench/_common.py).
SIZES = {
    "tiny": dict(vocab=256, hidden=64, inter=128, layers=4, heads=4, kv_heads=2),
    "small": dict(vocab=2048, hidden=256, inter=512, layers=4, heads=4, kv_heads=2),
    "full": dict(vocab=4096, hidden=512, inter=1024, layers=8, heads=4, kv_heads=2),
}
# export.max_shard_size per size: about ten files per four ranks, so placement has files to spread
MAX_SHARD = {"tiny": "64KB", "small": "1MB", "full": "4MB"}
VARIANTS = ("paddle", "seed", "routed")
STEP = 1  # the weights are harness.perturb(model, STEP)


# ---- the model ------------------------------------------------------------------------------------
def _aoa(experts: bool) -> dict:
    import ep_job
    import export_job

    return {"aoa_statements": [*export_job.AOA, *([ep_job.TOY_EXPERT_AOA] if experts else [])]}


def build_model(hcg, dims: dict, experts: str):
    """TinyParallelLlama at ``dims``; with ``experts`` (data | model): ``ep_job.NUM_EXPERTS`` experts per
    decoder layer ([hidden, inter], Paddle layout), each held whole by the rank of that axis that owns
    it (the others of the axis hold None), as ``ep_job.build_toy`` does at the harness's tiny size."""
    import paddle
    from paddle import nn

    import ep_job

    model = harness.TinyParallelLlama(hcg=hcg, **dims)
    model.expert_params = {}
    if experts != "none":
        class Expert(nn.Layer):
            def __init__(self, shape):
                super().__init__()
                self.weight = self.create_parameter(shape=list(shape), dtype=paddle.get_default_dtype())

        r, n = ep_job.axis_rank(hcg, "dp" if experts == "data" else "mp")
        per_rank = ep_job.NUM_EXPERTS // n
        if per_rank < 1:
            raise ValueError(f"{ep_job.NUM_EXPERTS} experts per layer over {n} ranks")
        shape = (dims["hidden"], dims["inter"])
        for i in model.layer_ids:
            layers = nn.LayerList([Expert(shape) if e // per_rank == r else None for e in range(ep_job.NUM_EXPERTS)])
            model.model.layers[str(i)].mlp.experts = layers
            for e, layer in enumerate(layers):
                if layer is not None:
                    model.expert_params[f"model.layers.{i}.mlp.experts.{e}.weight"] = layer.weight
    harness.perturb(model, STEP)
    for k, p in model.expert_params.items():
        p.set_value(paddle.to_tensor(harness.expected_global(k, tuple(p.shape), STEP)))
    return model


def sharded_state_dict(model) -> dict:
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    sd = harness.sharded_state_dict(model)
    for k, p in model.expert_params.items():  # whole, on the owner (and its replicas) only
        sd[k] = ShardedWeight(k, p, tuple(p.shape), tuple(p.shape), (0,) * len(p.shape))
    return sd


def expected_digest(name: str, global_shape) -> str:
    """sha256 of the destination ``name``'s bytes: the full source tensor, transposed where the AOA
    transposes it (every 2-D weight but the embedding: Paddle [in, out] Linear weights -> HF [out, in])."""
    g = harness.expected_global(name, tuple(global_shape), STEP)
    if g.ndim == 2 and name != "model.embed_tokens.weight":
        g = g.T
    return hashlib.sha256(np.ascontiguousarray(g).tobytes()).hexdigest()


def digest(t) -> str:
    from paddle_fullparam_callbacks.export.session.host import plain_array

    return hashlib.sha256(np.ascontiguousarray(plain_array(t)).tobytes()).hexdigest()


# ---- counting bytes -------------------------------------------------------------------------------
_NUM = {k: re.compile(rf"\b{k}:(\d+)") for k in ("bytes_received", "bytes_acked")}


def tcp_counts(pid: int) -> dict:
    """{(local, peer): (bytes_received, bytes_acked)} of every TCP socket of ``pid`` (``ss -tinpH``: a
    socket's line names its users, the indented line after it has its counters)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30).stdout
    socks, current = {}, None
    tag = f"pid={pid},"
    for line in out.splitlines():
        if line[:1].isspace():
            if current is not None:
                vals = [int(m.group(1)) if (m := _NUM[k].search(line)) else 0 for k in ("bytes_received", "bytes_acked")]
                socks[current] = tuple(vals)
                current = None
            continue
        parts = line.split()
        current = (parts[3], parts[4]) if tag in line and len(parts) >= 5 else None
    return socks


def tcp_delta(before: dict, after: dict) -> dict:
    """Bytes received / acked by this process's sockets between two samples (a socket opened between them
    counts from zero; one closed between them is lost, and counted in ``closed``)."""
    rx = sum(a[0] - before.get(k, (0, 0))[0] for k, a in after.items())
    tx = sum(a[1] - before.get(k, (0, 0))[1] for k, a in after.items())
    return {"received": rx, "sent": tx, "sockets": len(after), "opened": len(set(after) - set(before)),
            "closed": len(set(before) - set(after))}


def iface_counts(iface: str) -> dict:
    if not iface:
        return {}
    base = Path("/sys/class/net") / iface / "statistics"
    return {k: int((base / k).read_text()) for k in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")}


# ---- the plan's view ------------------------------------------------------------------------------
def floor_received(records, dmap, keep, rank: int) -> int:
    """Bytes the destinations in ``keep`` read that this rank does not hold, each distinct piece once
    (computed here from the records and the mapping, not by the routing plan)."""
    from paddle_fullparam_callbacks.assemble.routed import holdings_of, needs_of
    from paddle_fullparam_callbacks.plan.boxes import HoldingIndex

    index = HoldingIndex(holdings_of(records))
    missing = {}
    for name, needs in needs_of(dmap, keep).items():
        for need in needs:
            for piece in index.pieces(need):
                if rank not in piece.holders:
                    missing[(piece.key, piece.offset, piece.shape)] = piece.nbytes
    return sum(missing.values())


def prepare_variant(variant: str, ctx, source, sd, common: list) -> dict:
    """The package's plan for ``variant`` and what this rank keeps of it (as ExportSession.export does)."""
    from paddle_fullparam_callbacks.config.recipes import load_config
    from paddle_fullparam_callbacks.export.session.planning import plan_export

    overrides = {"paddle": ["assembler=paddle", "topology.schedule=seed"], "seed": ["topology.schedule=seed"],
                 "routed": ["topology.schedule=routed"]}[variant]
    config = load_config(None, [*common, *overrides])
    t0 = time.perf_counter()
    p = plan_export(ctx, config, source, sd)
    plan_s = time.perf_counter() - t0
    mesh_files, my_files = set(p.writes.files_of_mesh(ctx.mesh.index)), set(p.writes.files_of_rank(ctx.rank))
    targets = [n for n in p.order if p.plan.slots[n].file_index in mesh_files]
    keep = {n for n in targets if p.plan.slots[n].file_index in my_files}
    info = {
        "plan_seconds": plan_s,
        "files": len(p.plan.files),
        "files_here": sorted(my_files),
        "targets": len(targets),
        "kept": len(keep),
        "writes_bytes": sum(p.plan.slots[n].nbytes for n in keep),
        "snapshot_bytes": sum(p.plan.slots[n].nbytes for n in p.order),
        "snapshot_tensors": len(p.order),
        "floor_received": floor_received(p.records, p.dmap, sorted(keep), ctx.rank),
        "balance": p.balance, "balance_note": p.balance_note,
        "bucket_bytes": config.topology.bucket_for(1 if variant == "routed" else ctx.mesh.size),
    }
    if p.routes is not None:
        t = p.routes.traffic.get(ctx.rank)
        info.update(predicted_received=t.received if t else 0, predicted_sent=t.sent if t else 0,
                    predicted_received_cross_node=t.received_cross_node if t else 0,
                    predicted_sent_cross_node=t.sent_cross_node if t else 0,
                    packets_here=len(p.routes.packets_of(ctx.rank)), packets_total=len(p.routes.packets),
                    moves_total=len(p.routes.moves))
    return {"config": config, "p": p, "targets": targets, "keep": keep, "info": info}


def run_variant(prep: dict, ctx, source, sd, sink=None) -> dict:
    """``stream_tensors`` over the prepared plan: every tensor this rank keeps (hashed into ``sink``)."""
    from paddle_fullparam_callbacks.export.session.streaming import stream_tensors

    traffic: dict = {}
    n = 0
    for name, t in stream_tensors(ctx, prep["config"], sd, prep["p"], source, prep["targets"], prep["keep"],
                                  traffic=traffic):
        n += 1
        if sink is not None:
            sink[name] = digest(t)
        t = None
    return {"yielded": n, "traffic": traffic}


def profiled(fn, name: str):
    """``fn`` under cProfile when ``PFC_BENCH_PROFILE`` names a folder (stats to ``DIR/NAME.prof``)."""
    folder = os.environ.get("PFC_BENCH_PROFILE")
    if not folder:
        return fn

    def run():
        import cProfile

        prof = cProfile.Profile()
        try:
            return prof.runcall(fn)
        finally:
            os.makedirs(folder, exist_ok=True)
            prof.dump_stats(os.path.join(folder, name + ".prof"))

    return run


def timed(fn, iface: str) -> dict:
    """Barrier; counters; ``fn()`` timed; kernel counters right after; barrier; counters again."""
    import paddle.distributed as dist

    pid = os.getpid()
    gc.collect()
    dist.barrier()
    i0 = iface_counts(iface)
    k0 = tcp_counts(pid)
    t0 = time.perf_counter()
    error = None
    try:
        r = fn()
    except Exception as e:  # recorded; every rank finds the same (a refused plan) or the job times out
        r, error = {}, f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    k1 = tcp_counts(pid)
    dist.barrier()
    k2 = tcp_counts(pid)
    i1 = iface_counts(iface)
    r.update(seconds=seconds, kernel=tcp_delta(k0, k1), kernel_after_barrier=tcp_delta(k0, k2), error=error)
    if iface:
        r["iface_before"], r["iface_after"] = i0, i1
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    for a in ("dp", "mp", "pp"):
        ap.add_argument(f"--{a}", type=int, default=1)
    ap.add_argument("--experts", default="none", choices=("none", "data", "model"),
                    help="experts held whole by their owner on this axis (PaddleFormers' moe_group dp / mp)")
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-shard-size", default="", help="export.max_shard_size (default: per size)")
    ap.add_argument("--iface", default="", help="count this interface's bytes around each assembly (two nodes)")
    ns = ap.parse_args()

    import paddle
    import paddle.distributed as dist

    import _common as C

    C.quiet_logs()
    paddle.set_device("cpu")
    t_start = time.perf_counter()
    hcg = harness.init_fleet(dp=ns.dp, mp=ns.mp, pp=ns.pp)
    from paddle_fullparam_callbacks.export.source import ModelSource
    from paddle_fullparam_callbacks.trainer.topology import build_context

    rank = dist.get_rank()
    dims = SIZES[ns.size]
    model = build_model(hcg, dims, ns.experts)
    sd = sharded_state_dict(model)
    expert_axes = {"none": (), "data": ("data",), "model": ("model",)}[ns.experts]
    with harness.gloo_safe_group_creation():
        ctx = build_context(expert_axes=expert_axes)
    source = ModelSource(sharded_state_dict=lambda: sd, aoa_config=_aoa(ns.experts != "none"))
    common = [f"export.max_shard_size={ns.max_shard_size or MAX_SHARD[ns.size]}", "on_error=raise"]
    report = {
        "rank": rank, "case": ns.case, "size": ns.size, "dims": dims, "degrees": dict(dp=ns.dp, mp=ns.mp, pp=ns.pp),
        "experts": ns.experts, "pid": os.getpid(), "mesh": [list(r) for r in ctx.mesh.rows], "mesh_index": ctx.mesh.index,
        "nodes": list(ctx.nodes), "pod": os.environ.get("POD_NAME"), "iface": ns.iface or None,
        "routed_groups": type(getattr(ctx, "pair_groups", None)).__name__,
        "held_bytes": int(sum(int(sw.local_tensor.numel()) * 4 for sw in sd.values())),
        "setup_seconds": None, "variants": {},
    }
    preps = {}
    for v in ns.variants.split(","):
        preps[v] = prepare_variant(v, ctx, source, sd, common)
        report["variants"][v] = {"plan": preps[v]["info"], "reps": []}
    report["setup_seconds"] = time.perf_counter() - t_start

    # warm-up: every variant once, hashing what this rank keeps
    runnable = []
    for v, prep in preps.items():
        sink: dict = {}
        r = timed(lambda: run_variant(prep, ctx, source, sd, sink), "")
        errors = [e for e in ctx.all_gather_object(r["error"]) if e]
        entry = report["variants"][v]
        entry["warmup"] = {k: r.get(k) for k in ("seconds", "yielded", "traffic", "kernel", "error")}
        if errors:
            entry["not_run"] = errors[0]
            continue
        runnable.append(v)
        kept = sorted(sink)
        # the mesh's shard records know every source's global shape (destination names are source names here)
        global_shapes = {rec.key: rec.global_shape for rec in prep["p"].records}
        bad = [n for n in kept if n not in global_shapes or sink[n] != expected_digest(n, global_shapes[n])]
        entry["check"] = {"kept_names": kept, "kept_as_planned": set(kept) == prep["keep"],
                          "matches_full_tensors": not bad, "mismatched": bad[:5]}

    for rep in range(ns.reps):
        order = runnable[rep % max(1, len(runnable)):] + runnable[:rep % max(1, len(runnable))]
        for v in order:
            r = timed(profiled(lambda: run_variant(preps[v], ctx, source, sd), f"{v}-rank{rank}-rep{rep}"), ns.iface)
            r["rep"] = rep
            report["variants"][v]["reps"].append(r)
    dist.barrier()
    report["total_seconds"] = time.perf_counter() - t_start
    print("ASMBENCH " + json.dumps(report), flush=True)
    dist.barrier()
    # leave without the process groups' and stores' destructors (tests/multirank/pipe_job.py: launched)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
