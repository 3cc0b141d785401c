"""Launched on 4 ranks (dp2 x mp2): inconsistent inputs must fail on EVERY rank with the SAME
message, never hang and never write a snapshot; a good export afterwards still works.

    python -m paddle.distributed.launch --nproc_per_node 4 bad_input_job.py --out DIR

Prints ``BAD {json}`` per rank: {case: message} and the outcome of the final good export.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()

    import paddle.distributed as dist

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportError, ExportSession, ModelSource
    from paddle_fullparam_callbacks.trainer.topology import build_context
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    hcg = harness.init_fleet(dp=2, mp=2)
    rank = dist.get_rank()
    model = harness.TinyParallelLlama(hcg=hcg)
    harness.perturb(model, 1)
    ctx = build_context()

    def sd_with(change=None):
        sd = dict(harness.sharded_state_dict(model))
        if change:
            change(sd)
        return sd

    def lie_about_shape(sd):
        if rank == 1:
            sw = sd["model.norm.weight"]
            sd["model.norm.weight"] = ShardedWeight(sw.key, sw.local_tensor, sw.local_shape, (sw.global_shape[0] * 2,), sw.global_offset)

    def drop_a_shard(sd):
        if rank == 3:
            del sd["model.layers.0.self_attn.q_proj.weight"]

    def overlap_differently(sd):
        if rank == 1:  # claims the slice starting 4 columns earlier: overlaps rank 0's without being a replica
            sw = sd["model.layers.1.mlp.up_proj.weight"]
            off = (sw.global_offset[0], sw.global_offset[1] - 4)
            sd[sw.key] = ShardedWeight(sw.key, sw.local_tensor, sw.local_shape, sw.global_shape, off)

    def replica_drift(sd):
        # a norm weight replicated over the mp ranks of a mesh drifted on its second rank (in both
        # meshes, since either may be the one that assembles it)
        if rank in (1, 3):
            sw = sd["model.norm.weight"]
            sd[sw.key] = ShardedWeight(sw.key, sw.local_tensor + 1.0, sw.local_shape, sw.global_shape, sw.global_offset)

    cases = {
        "global_shape_differs": (lie_about_shape, []),
        "uncovered_elements": (drop_a_shard, []),
        "overlapping_slices": (overlap_differently, []),
        "replicas_differ": (replica_drift, []),
        "plans_differ": (None, ["export.max_shard_size=1KB"] if rank == 0 else []),
    }
    results = {}
    for name, (change, extra) in cases.items():
        cfg = load_config(None, [f"output_dir={ns.out}", "export.max_shard_size=3KB", *extra])
        session = ExportSession(cfg, ns.out, ctx=ctx)
        session.start()
        source = ModelSource(sharded_state_dict=lambda change=change: sd_with(change))
        try:
            session.export(source, 7)
            results[name] = "NO ERROR"
        except ExportError as e:
            results[name] = str(e)
    # the job goes on: a consistent export afterwards works
    cfg = load_config(None, [f"output_dir={ns.out}", "export.max_shard_size=3KB"])
    session = ExportSession(cfg, ns.out, ctx=ctx)
    session.start()
    info = session.export(ModelSource(sharded_state_dict=lambda: sd_with()), 8)
    print("BAD " + json.dumps({"rank": rank, "cases": results, "good": info.name}), flush=True)


if __name__ == "__main__":
    main()
