"""Launched on 2 ranks: pure data parallelism through the real PaddleFormers Trainer, real
training steps and evaluations on CPU, the callback exporting every 3 steps, on save and on
evaluation, tracking eval_loss (the decision and the metric are taken on rank 0 and shared).

    python -m paddle.distributed.launch --nproc_per_node 2 trainer_dp_job.py --out DIR

Each rank is a mesh of one (no communication to assemble); the two ranks split the files and
write them at the same time. Prints ``TRAIN {json}`` per rank; each rank saves its final
weights to ``DIR/final-rankN.npz`` for the bitwise check.
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

    import numpy as np
    import paddle.distributed as dist

    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_tiny_llama, make_trainer, trainer_args

    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={ns.out}/snaps", "trigger.every_n_steps=3", "trigger.on_save=true",
        "trigger.on_evaluate=true", "retention.metric=eval_loss", "retention.keep_best=1",
        "export.max_shard_size=100KB", "retention.keep_last=2", "on_error=raise",
    ])
    # the Trainer's fleet.init creates the groups: gloo needs the safe creation on CPU (see harness)
    with harness.gloo_safe_group_creation():
        args = trainer_args("paddleformers", f"{ns.out}/trainer", 8, save_steps=4, sharding="", max_grad_norm=0,
                            evaluation_strategy="steps", eval_steps=4, per_device_eval_batch_size=4)
        model = make_tiny_llama(seed=0)
        trainer = make_trainer("paddleformers", model, args, [cb], eval_dataset=TokenDataset(n=16, seed=1))
    trainer.train()
    rank = dist.get_rank()
    np.savez(f"{ns.out}/final-rank{rank}.npz", **{k: v.numpy() for k, v in model.state_dict().items()})
    dist.barrier()
    print("TRAIN " + json.dumps({
        "rank": rank, "world": dist.get_world_size(), "events": cb.events, "decisions": cb.decisions, "errors": cb.errors,
        "steps": [s.step for s in cb.snapshots], "files_written_here": [s.files_written_here for s in cb.snapshots],
        "num_splits": cb.session.ctx.topology.num_splits,
    }), flush=True)


if __name__ == "__main__":
    main()
