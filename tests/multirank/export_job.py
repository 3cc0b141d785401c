"""Launched on every rank: real fleet topology, real parallel layers, the real callback.

    python -m paddle.distributed.launch --nproc_per_node 4 export_job.py --mp 2 --pp 2 --out DIR [--paddle]

Fires the trainer's own callback events (PaddleFormers ``CallbackHandler``) at steps 1..4 with
``every_n_steps=2`` and an ``on_save`` at step 3; before each event the weights change as an
optimizer step would (``harness.perturb``) and every rank dumps its shards to
``DIR/dump/step-N`` so that the test can rebuild the full tensors with plain numpy. With
``--paddle`` a second callback exports the same steps with ``assembler: paddle`` into
``DIR/paddle``; with ``--seed``, one with ``topology.schedule: seed`` into ``DIR/seed``. Prints ``EXPORT {json}`` per rank (decisions, files written, collectives).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

# Paddle [in, out] Linear weights become HF [out, in]; norms and embeddings are renamed as-is
AOA = [
    "model.layers.$LAYER_ID.self_attn.q_proj.weight^T -> model.layers.$LAYER_ID.self_attn.q_proj.weight",
    "model.layers.$LAYER_ID.self_attn.k_proj.weight^T -> model.layers.$LAYER_ID.self_attn.k_proj.weight",
    "model.layers.$LAYER_ID.self_attn.v_proj.weight^T -> model.layers.$LAYER_ID.self_attn.v_proj.weight",
    "model.layers.$LAYER_ID.self_attn.o_proj.weight^T -> model.layers.$LAYER_ID.self_attn.o_proj.weight",
    "model.layers.$LAYER_ID.mlp.gate_proj.weight^T -> model.layers.$LAYER_ID.mlp.gate_proj.weight",
    "model.layers.$LAYER_ID.mlp.up_proj.weight^T -> model.layers.$LAYER_ID.mlp.up_proj.weight",
    "model.layers.$LAYER_ID.mlp.down_proj.weight^T -> model.layers.$LAYER_ID.mlp.down_proj.weight",
    "lm_head.weight^T -> lm_head.weight",
]


def main():
    ap = argparse.ArgumentParser()
    for a in ("dp", "mp", "pp", "sharding"):
        ap.add_argument(f"--{a}", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--paddle", action="store_true", help="also export with assembler=paddle")
    ap.add_argument("--seed", action="store_true", help="also export with topology.schedule=seed (into DIR/seed)")
    ap.add_argument("--dtype", default="keep")
    ap.add_argument("--bucket", default="2MB", help="topology.bucket_bytes: small forces many rounds and broadcasts")
    ap.add_argument("--param-dtype", default="float32", help="dtype of the model's parameters (bfloat16: bf16 training)")
    ap.add_argument("--device", default="cpu", help="where the parameters live (fakedev: the fake accelerator)")
    ap.add_argument("--budget", default=None, help="export.device_memory_budget")
    ap.add_argument("--chunk", type=int, default=None,
                    help="assemble.mesh.BCAST_CHUNK_BYTES (a routed move's packets, a broadcast's pieces), with "
                         "topology.memory_growth_threshold=3KB (the seed schedule broadcasts the larger slices) and "
                         "poisoned scratch: pieces that do not divide the slices, a byte no one wrote shows")
    ap.add_argument("--late", type=float, default=0.0,
                    help="seconds the last rank spends before the save event (a slow checkpoint save)")
    ns = ap.parse_args()

    import contextlib

    import paddle.distributed as dist
    from paddleformers.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    from paddle_fullparam_callbacks import FullParamExportCallback

    hcg = harness.init_fleet(dp=ns.dp, mp=ns.mp, pp=ns.pp, sharding=ns.sharding, device=ns.device)
    rank = dist.get_rank()
    model = harness.TinyParallelLlama(hcg=hcg)
    if ns.param_dtype != "float32":
        model.to(dtype=ns.param_dtype)
        bad = [k for k, s in model.param_specs.items() if str(s.param.dtype) != f"paddle.{ns.param_dtype}"]
        assert not bad, f"parameters not cast to {ns.param_dtype}: {bad[:3]}"
    model.sharded_state_dict = lambda: harness.sharded_state_dict(model)  # see harness docstring
    common = ["trigger.every_n_steps=2", "trigger.on_save=true", "trigger.on_train_end=true",
              "export.max_shard_size=3KB", f"export.dtype={ns.dtype}", "export.aoa=" + json.dumps(AOA),
              "retention.keep_last=0", "on_error=raise", f"topology.bucket_bytes={ns.bucket}",
              *([f"export.device_memory_budget={ns.budget}"] if ns.budget else []),
              *(["topology.memory_growth_threshold=3KB"] if ns.chunk else [])]
    poison = contextlib.nullcontext()
    if ns.chunk:
        from paddle_fullparam_callbacks.assemble import mesh
        from paddle_fullparam_callbacks.host.poison import poisoned

        mesh.BCAST_CHUNK_BYTES, poison = ns.chunk, poisoned(rank)
    callbacks = [FullParamExportCallback(None, overrides=[f"output_dir={ns.out}/builtin", *common])]
    if ns.paddle:
        callbacks.append(FullParamExportCallback(None, overrides=[f"output_dir={ns.out}/paddle", "assembler=paddle", *common]))
    if ns.seed:
        callbacks.append(FullParamExportCallback(None, overrides=[f"output_dir={ns.out}/seed", "topology.schedule=seed",
                                                                  *common]))
    handler = CallbackHandler(callbacks, model, None, None, None)
    args = types.SimpleNamespace(output_dir=ns.out)
    state, control = TrainerState(), TrainerControl()
    with poison:
        handler.on_train_begin(args, state, control)
        peaks = []  # the device's allocation peak of each event, above what it held before (None on CPU)
        for step in range(1, 5):
            harness.perturb(model, step)
            harness.dump_shards(harness.sharded_state_dict(model), f"{ns.out}/dump/step-{step}")
            state.global_step = step
            peaks.append(harness.device_peak(lambda: handler.on_step_end(args, state, control))[1])
            if step == 3:
                if ns.late and rank == dist.get_world_size() - 1:
                    time.sleep(ns.late)  # the others wait in the export's decision exchange meanwhile
                peaks.append(harness.device_peak(lambda: handler.on_save(args, state, control))[1])
        peaks.append(harness.device_peak(lambda: handler.on_train_end(args, state, control))[1])
    dist.barrier()
    cb = callbacks[0]
    print("EXPORT " + json.dumps({
        "rank": rank,
        "events": [c.events for c in callbacks],
        "errors": [c.errors for c in callbacks],
        "steps": [s.step for s in cb.snapshots],
        "files_written_here": [s.files_written_here for s in cb.snapshots],
        "mesh": [list(r) for r in cb.session.ctx.mesh.rows],
        "num_splits": cb.session.ctx.topology.num_splits,
        "device_peaks": peaks,
        "places": sorted({str(p.place) for p in model.parameters()}),
        "device_to_host_s": [s.timings.get("device_to_host_s") for s in cb.snapshots],
    }), flush=True)


if __name__ == "__main__":
    main()
