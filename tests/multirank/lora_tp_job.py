"""Launched on every rank: a LoRA Llama under real tensor parallelism (mp2), exported by the callback.

    python -m paddle.distributed.launch --nproc_per_node 2 lora_tp_job.py --framework paddleformers|paddlenlp \
        --variants unfused[,fused] --out DIR [--pp 2]

Per variant, on the real topology (``harness.init_fleet(mp=2)``):

1. builds the framework's ``LlamaForCausalLM`` for tensor parallelism (PaddleFormers
   ``tensor_model_parallel_size=2``, PaddleNLP ``tensor_parallel_degree=2`` and its rank) and wraps
   it in the framework's ``LoRAModel`` (``VARIANTS``: targets, r, alpha, rslora): column- and
   row-parallel LoRA layers, fused q/k/v and gate/up in PaddleNLP's ``fused`` variant;
2. gives every tensor (base weights, ``lora_A``, ``lora_B``: a nonzero ``lora_B``) this rank's block of a
   seeded single-process tensor (``global_values``) at the place the (fixed) sharded state dict
   gives it, as an optimizer step would leave them; a training step cannot run on CPU under tensor
   parallelism (CPU_CLUSTER.md);
3. fires the trainer's callback events (``on_train_begin``, ``on_step_end`` at step 1 with
   ``every_n_steps=1``) with ``export.peft_adapter=inside``: one merged snapshot with its adapter in
   ``DIR/<variant>/hf-step-000001``.

``--pp 2`` (PaddleNLP): the same on two pipeline stages (``LlamaForCausalLMPipe`` in ``LoRAModel``)
instead, into ``DIR/<variant>-pp2``. The test (``tests/test_*_lora.py``) builds the same model on one
process with the same values and compares. Prints ``LORA_TP {json}`` per rank and variant.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=128)
VARIANTS = {
    "unfused": (dict(num_key_value_heads=2), [r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"], dict(r=4, lora_alpha=8)),
    # PaddleNLP only: fused q/k/v (grouped per key-value head) and gate/up, rslora with an inexact scaling
    "fused": (dict(num_key_value_heads=4, fuse_attention_qkv=True, fuse_attention_ffn=True),
              [r".*\.(qkv|o)_proj", r".*\.(gate_up_fused|down)_proj"], dict(r=3, lora_alpha=5, rslora=True)),
}


def global_values(name: str, shape, pad_row=None) -> np.ndarray:
    """The single-process value of ``name``: seeded by its name, scaled like a trained model; the
    embedding's padding row zero (a vocab-parallel embedding has no padding index: equal functions)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in shape)
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name:
        out = rng.standard_normal(shape).astype(np.float32)
        if pad_row is not None:
            out[pad_row] = 0.0
        return out
    if name.endswith(".lora_B"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def build(framework: str, variant: str, mp: int = 1, mp_rank: int = 0, pp: int = 1):
    """(LoRAModel, base model) of the variant; ``mp > 1``: built for tensor parallelism; ``pp > 1``:
    PaddleNLP's ``LlamaForCausalLMPipe`` (a PipelineLayer) wrapped in LoRAModel."""
    import paddle

    paddle.seed(0)
    model_kw, targets, lora_kw = VARIANTS[variant]
    if pp > 1:
        import paddle.distributed as dist
        from paddlenlp.peft import LoRAConfig, LoRAModel
        from paddlenlp.transformers import LlamaConfig, LlamaForCausalLMPipe

        if not hasattr(dist.ParallelEnv(), "_device_id"):  # CPU: PipelineLayer reads it (CPU_CLUSTER.md)
            dist.ParallelEnv._device_id = 0
        base = LlamaForCausalLMPipe(LlamaConfig(**TINY, **model_kw))
        return LoRAModel(base, LoRAConfig(target_modules=targets, **lora_kw)), base
    if framework == "paddleformers":
        from paddleformers.peft import LoRAConfig, LoRAModel
        from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

        tp = dict(tensor_model_parallel_size=mp) if mp > 1 else {}
        base = LlamaForCausalLM(LlamaConfig(**TINY, **model_kw, fuse_rms_norm=False, **tp))
    else:
        from paddlenlp.peft import LoRAConfig, LoRAModel
        from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

        tp = dict(tensor_parallel_degree=mp, tensor_parallel_rank=mp_rank) if mp > 1 else {}
        base = LlamaForCausalLM(LlamaConfig(**TINY, **model_kw, **tp))
    return LoRAModel(base, LoRAConfig(target_modules=targets, **lora_kw)), base


def _split_actions(base) -> dict:
    """PaddleNLP's own split of single-process tensors for this rank (``from_pretrained`` under tensor
    parallelism): a fused gate/up weight's rank block is [gate_r | up_r], not a contiguous slice."""
    cfg = base.config
    if type(base).__module__.startswith("paddlenlp") and getattr(cfg, "tensor_parallel_degree", 1) > 1:
        return type(base)._get_tensor_parallel_mappings(cfg, is_split=True)
    return {}


def set_values(base) -> dict:
    """Every tensor of ``base`` (LoRA ones included) := this rank's block of ``global_values``, placed as
    the framework places the weight (a column layer's ``lora_B`` and a row layer's ``lora_A`` split like
    their weight, as training under tensor parallelism leaves them); returns the (fixed) sharded state
    dict's {key: (global shape, offset)}."""
    import paddle

    from paddle_fullparam_callbacks.models.pipe import single_named
    from paddle_fullparam_callbacks.models.shard_fixes import fixed_sharded_state_dict

    pad = getattr(base.config, "pad_token_id", None)
    sd = fixed_sharded_state_dict(base, single_named(base))()
    actions = _split_actions(base)
    with paddle.no_grad():
        for key, sw in sd.items():
            full = global_values(key, sw.global_shape, pad)
            weight = key.rsplit(".", 1)[0] + ".weight" if key.endswith((".lora_A", ".lora_B")) else key
            act = actions.get(weight[len("llama."):] if weight.startswith("llama.") else weight)
            column = act is not None and act.keywords.get("is_column", True)
            if act is not None and (key == weight or key.endswith(".lora_B") == column):
                block = act(full)
            else:
                block = full[tuple(slice(o, o + n) for o, n in zip(sw.global_offset, sw.local_shape))]
            assert tuple(block.shape) == tuple(sw.local_tensor.shape), (key, block.shape, sw.local_tensor.shape)
            sw.local_tensor.set_value(paddle.to_tensor(np.ascontiguousarray(block)))
    return {k: (list(map(int, sw.global_shape)), list(map(int, sw.global_offset))) for k, sw in sd.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", required=True, choices=("paddleformers", "paddlenlp"))
    ap.add_argument("--variants", default="unfused")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pp", type=int, default=1, help="2: pipeline (PaddleNLP) instead of tensor parallelism")
    ns = ap.parse_args()

    import paddle.distributed as dist

    if ns.framework == "paddleformers":
        from paddleformers.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState
    else:
        from paddlenlp.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState
    from paddle_fullparam_callbacks import FullParamExportCallback

    hcg = harness.init_fleet(mp=1, pp=2) if ns.pp > 1 else harness.init_fleet(mp=2)
    rank, mp_rank = dist.get_rank(), hcg.get_model_parallel_rank()
    for variant in ns.variants.split(","):
        lm, base = build(ns.framework, variant, 1 if ns.pp > 1 else 2, mp_rank, ns.pp)
        places = set_values(base)
        out = f"{ns.out}/{variant}" + ("-pp2" if ns.pp > 1 else "")
        cb = FullParamExportCallback(None, overrides=[f"output_dir={out}", "trigger.every_n_steps=1", "on_error=raise",
                                                      "trigger.on_train_end=false", "export.peft_adapter=inside"])
        handler = CallbackHandler([cb], lm, None, None, None)
        args, state, control = types.SimpleNamespace(output_dir=out), TrainerState(), TrainerControl()
        report = {"variant": variant, "rank": rank, "mp_rank": mp_rank,
                  "classes": sorted({type(layer).__name__ for layer in base.sublayers() if "LoRA" in type(layer).__name__}),
                  "lora_places": {k: v for k, v in places.items() if ".0.self_attn." in k and "lora" in k}}
        try:
            handler.on_train_begin(args, state, control)
            state.global_step = 1
            handler.on_step_end(args, state, control)
            report.update(errors=[str(e) for e in cb.errors], snapshots=[str(s.path) for s in cb.snapshots])
        except Exception as e:  # the same on every rank: reported, next variant
            report["error"] = f"{type(e).__name__}: {e}"
        cb.session.close() if cb.session is not None else None
        print("LORA_TP " + json.dumps(report), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
