"""A trainer that saves a checkpoint at step 2 *and* exports it with the callback (the reference for
``paddle-fullparam convert``). One process (``--mode single``) or launched on 2 ranks:

    python convert_job.py --framework paddleformers --mode single --out DIR
    python -m paddle.distributed.launch --nproc_per_node 2 convert_job.py --framework paddlenlp --mode mp2 --out DIR

* ``single`` / ``dp2``: real training steps (``Trainer.train``); the checkpoint and the callback's
  snapshot come from the trainer's own save at step 2.
* ``mp2`` / ``pp2``: a tensor- or pipeline-parallel training step cannot run on CPU, so each rank
  takes a local step (loss ``sum(p*p)``, the real optimizer), then the trainer's own
  ``_save_checkpoint`` and the ``on_save`` event, as ``Trainer.train`` does after a step.
* PaddleNLP also writes the same weights as a unified checkpoint (``DIR/uc/checkpoint-2``:
  PaddleNLP's ``save_unified_checkpoint``, its merged safetensors layout).

Writes ``DIR/trainer/checkpoint-2``, ``DIR/snaps/hf-step-000002`` (the callback's),
``DIR/model_config.json`` (the model's config as its pretrained directory would hold it: a
PaddleFormers flex checkpoint has none) and, single process, ``DIR/logits.npy`` for ``DIR/ids.npy``.
Prints ``CONVERT_JOB {json}`` per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IDS = [[0, 1, 2, 511, 5, 64, 99, 3, 256, 17, 0, 2], [1, 42, 7, 2, 0, 88, 113, 510, 9, 1, 63, 65]]


def build(framework: str, mode: str, tied: bool, fused: bool, tp: int, tp_rank: int):
    import paddle

    from paddle_fullparam_callbacks.cli.demo import TINY_LLAMA, make_tiny_llama

    over = {"tie_word_embeddings": tied}
    if fused:
        over.update(fuse_attention_qkv=True, fuse_attention_ffn=True)
    if mode == "mp2":
        over.update({"tensor_model_parallel_size": 2} if framework == "paddleformers"
                    else {"tensor_parallel_degree": tp, "tensor_parallel_rank": tp_rank})
    if mode == "pp2":
        import paddle.distributed as dist

        if not hasattr(dist.ParallelEnv(), "_device_id"):
            dist.ParallelEnv._device_id = 0  # Paddle 3.3.1 CPU build: PipelineLayer reads it (pp_layers.py:453)
        mod = __import__(f"{framework}.transformers", fromlist=["LlamaConfig", "LlamaForCausalLMPipe"])
        paddle.seed(0)
        return mod.LlamaForCausalLMPipe(mod.LlamaConfig(**TINY_LLAMA, fuse_rms_norm=False, **over)), over
    return make_tiny_llama(framework, seed=0, **over), over


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=("paddleformers", "paddlenlp"), required=True)
    ap.add_argument("--mode", choices=("single", "dp2", "mp2", "pp2"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="a bfloat16 model (no step: AdamW has no bf16 CPU kernel)")
    ns = ap.parse_args()
    fw, out = ns.framework, ns.out

    import contextlib

    import numpy as np

    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.cli.demo import TINY_LLAMA, make_trainer, trainer_args

    kw = dict(max_grad_norm=0, save_steps=2)
    if fw == "paddleformers":
        kw.update(sharding="")
        kw.update({"mp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}.get(ns.mode, {}))
    else:
        kw.update(sharding="") if ns.mode == "dp2" else None
        kw.update({"mp2": dict(tensor_parallel_degree=2), "pp2": dict(pipeline_parallel_degree=2)}.get(ns.mode, {}))
    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={out}/snaps", "trigger.on_save=true", "on_error=raise", "export.max_shard_size=100KB"])
    report = {"mode": ns.mode}
    guard = contextlib.nullcontext()
    if ns.mode != "single":
        import harness

        guard = harness.gloo_safe_group_creation()  # gloo on CPU: see harness
    with guard:
        args = trainer_args(fw, f"{out}/trainer", 2, **kw)
        tp = getattr(args, "tensor_parallel_degree", 1)
        tp_rank = getattr(args, "tensor_parallel_rank", 0)
        model, over = build(fw, ns.mode, ns.tied, ns.fused, tp, tp_rank)
        if ns.bf16:
            model.to(dtype="bfloat16")
        trainer = make_trainer(fw, model, args, [cb])
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    if ns.mode in ("single", "dp2") and not ns.bf16:
        trainer.train()
    else:
        trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
        trainer.create_optimizer_and_scheduler(num_training_steps=2)
        if ns.bf16:  # the optimizer's state (moments, fp32 master weights) without a step
            import paddle

            trainer.optimizer._multi_precision = True
            trainer.optimizer._create_accumulators(paddle.static.default_main_program().global_block(),
                                                   [p for p in model.parameters() if not p.stop_gradient])
        else:
            loss = sum((p * p).sum() for p in model.parameters())
            loss.backward()
            trainer.optimizer.step()
            trainer.optimizer.clear_grad()
        trainer.state.global_step = 2
        trainer._save_checkpoint(trainer.model)
        trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
    if fw == "paddlenlp":
        try:
            from paddlenlp.trainer.plugins.unified_checkpoint import save_unified_checkpoint

            uc = os.path.join(out, "uc", "checkpoint-2")
            save_unified_checkpoint(trainer.args, trainer.model, trainer.optimizer, uc, safe_serialization=True)
            if rank == 0:
                shutil.copy(os.path.join(out, "trainer", "checkpoint-2", "trainer_state.json"), uc)
            report["unified"] = True
        except Exception:
            report["unified_error"] = traceback.format_exc()[-2000:]
    if rank == 0:
        plain = dict(TINY_LLAMA, fuse_rms_norm=False, architectures=["LlamaForCausalLM"],
                     **{k: v for k, v in over.items() if not k.startswith("tensor_")})
        with open(os.path.join(out, "model_config.json"), "w") as f:
            json.dump(plain, f)
        if ns.mode == "single" and not ns.bf16:
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from _helpers import paddle_logits

            ids = np.array(IDS, dtype="int64")
            np.save(os.path.join(out, "ids.npy"), ids)
            np.save(os.path.join(out, "logits.npy"), paddle_logits(model, ids))
    report.update(rank=rank, steps=[s.step for s in cb.snapshots], errors=cb.errors)
    print("CONVERT_JOB " + json.dumps(report), flush=True)
    if ns.mode != "single":
        import paddle.distributed as dist

        dist.barrier()
        # everything is written: leave without the process groups' and stores' destructors, whose
        # teardown order across ranks is not this job's subject (seen to abort a rank, as in pipe_job.py)
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
