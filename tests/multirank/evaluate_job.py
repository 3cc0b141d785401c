"""Launched on 4 ranks: pure data parallelism through the real PaddleFormers Trainer with the
evaluation hook (``attach``): a snapshot every 2 steps, each scored by the fake evaluator the test
wrote, ``best`` by the downstream score, and each served by the engine at ``--engine`` (the test's vLLM
stand-in).

    python -m paddle.distributed.launch --nproc_per_node 4 evaluate_job.py --out DIR --command CMD --python PY --engine URL

Only the coordinator evaluates and serves (once per snapshot) and logs the scores through its trainer;
the other ranks take part in the start's exchanges and nothing else. Prints ``EVAL {json}`` per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import harness  # noqa: E402
from _evaluators import Recorder  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--engine", required=True)
    ns = ap.parse_args()

    import paddle.distributed as dist

    from paddle_fullparam_callbacks import attach
    from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_tiny_llama, make_trainer, trainer_args

    logged = Recorder()
    with harness.gloo_safe_group_creation():
        args = trainer_args("paddleformers", f"{ns.out}/trainer", 8, save_steps=100, sharding="", max_grad_norm=0)
        trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), args, [logged], train_dataset=TokenDataset(n=64))
    cb = attach(trainer, None, overrides=[
        f"output_dir={ns.out}/snaps", "trigger.every_n_steps=2", f"evaluate.command={ns.command}",
        f"evaluate.python={ns.python}", "retention.metric=evaluate.score", "retention.mode=max", "retention.keep_best=1",
        "retention.keep_last=1", "export.max_shard_size=100KB", "on_error=raise", f"serve.url={ns.engine}",
        "serve.timeout_s=30", "serve.reload_timeout_s=60",
    ])
    trainer.train()
    dist.barrier()
    print("EVAL " + json.dumps({
        "rank": dist.get_rank(), "world": dist.get_world_size(), "events": cb.events, "decisions": cb.decisions,
        "errors": cb.errors, "results": [[ev.name, ev.status, ev.scores.get("score")] for ev in cb.evaluation.results],
        "logged": logged.logs, "served": [[j.name, j.record["status"]] for j in cb.serving.results],
    }), flush=True)


if __name__ == "__main__":
    main()
