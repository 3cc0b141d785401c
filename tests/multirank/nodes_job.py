"""Launched as two "nodes" of 2 ranks each (``nodes.run_two_nodes``) or as one node of 4: pure data
parallelism through the real PaddleFormers Trainer, the callback exporting every 2 steps into
``--snaps`` (relative: each node's own working directory; absolute: one shared directory).

Prints ``NODES {json}`` per rank: the callback's events, errors and snapshots, or the error that
stopped the job at start and how long after the rank's start it came.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--snaps", required=True)
    ap.add_argument("--trainer-dir", required=True)
    ap.add_argument("--hook", action="store_true", help="the checkpoint hook too (snapshots in checkpoint-N/hf)")
    ns = ap.parse_args()

    import paddle.distributed as dist

    from paddle_fullparam_callbacks import attach
    from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args

    overrides = [f"output_dir={ns.snaps}", "trigger.every_n_steps=2", "export.max_shard_size=100KB", "on_error=raise"]
    with harness.gloo_safe_group_creation():
        args = trainer_args("paddleformers", ns.trainer_dir, 4, save_steps=2 if ns.hook else 1000, sharding="",
                            max_grad_norm=0)
        model = make_tiny_llama(seed=0)
        trainer = make_trainer("paddleformers", model, args, [])
    cb = attach(trainer, None, overrides=overrides + (["checkpoint_hook.enabled=true"] if ns.hook else []))
    out = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    try:
        trainer.train()
    except Exception as e:  # a refusal at start: every rank must raise the same one
        out.update(error=f"{type(e).__name__}: {e}", after_s=round(time.time() - T0, 1))
        print("NODES " + json.dumps(out), flush=True)
        sys.exit(3)
    out.update(events=cb.events, errors=cb.errors, snapshots=[str(s.path) for s in cb.snapshots],
               start_timings=cb.session.start_timings)
    print("NODES " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
