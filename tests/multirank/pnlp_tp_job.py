"""Launched on every rank: PaddleNLP 2.8.1 Llama under real tensor parallelism, exported by the callback.

    python -m paddle.distributed.launch --nproc_per_node N pnlp_tp_job.py --mp 2 [--dp 2] [--pp 2] \
        --out DIR [--variants fused,unfused] [--checks]

Per variant (``VARIANTS``), on the real topology (``harness.init_fleet``):

1. builds PaddleNLP's ``LlamaForCausalLM`` the way PaddleNLP builds it for tensor parallelism
   (``LlamaConfig(..., tensor_parallel_degree=mp, tensor_parallel_rank=hcg.get_model_parallel_rank())``),
   or with ``--pp`` its ``LlamaForCausalLMPipe`` (a ``PipelineLayer``);
2. before each step, sets every parameter to this rank's share of a single-process weight
   (``weight_values``, a seeded function of the single-process name, shape and step) cut by
   PaddleNLP's own checkpoint split actions (``_get_tensor_parallel_mappings(config, is_split=True)``,
   what ``from_pretrained`` does under tensor parallelism), as an optimizer step would change them;
3. fires the trainer's callback events (PaddleNLP ``CallbackHandler``) with ``every_n_steps=1``
   at steps 1 and 2: two snapshots in ``DIR/<variant>/``;
4. compares the model's ``sharded_state_dict()`` before and after ``shard_fixes`` with the layout
   PaddleNLP's split actions give (``layout_problems``).

``--checks`` (first variant): the unfixed dict's export fails (the issue's symptom), and a
parameter whose marks contradict its layer is refused with a message naming it.

The pipeline model's ``sharded_state_dict()`` uses pipeline names (``1.self_attn.q_proj.weight``,
``4.weight``); the package names them as the single model does (PaddleNLP's own
``_pp_to_single_mapping``), picks the ``llama_paddlenlp`` preset for the pipe class as for
``LlamaForCausalLM``, and writes its statements for the whole model (every mesh rank's tensors).

Prints ``PNLP_TP {json}`` per rank and variant, and ``PNLP_CHECKS {json}`` with ``--checks``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=128, rms_norm_eps=1e-6)
VARIANTS = {
    # kv heads divisible by 4: fused q/k/v splits by key-value group on up to 4 ranks
    "fused": dict(num_key_value_heads=4, fuse_attention_qkv=True, fuse_attention_ffn=True),
    # kv heads 2: split over 2 ranks, replicated (plain Linear, PaddleNLP's kv_indices) over 4
    "unfused": dict(num_key_value_heads=2, fuse_attention_qkv=False, fuse_attention_ffn=False),
}


def config_kwargs(variant: str) -> dict:
    return {**BASE, **VARIANTS[variant.split(":")[0]]}


def weight_values(name: str, shape, step: int) -> np.ndarray:
    """The single-process value of parameter ``name`` at ``step``: seeded by (name, step), so
    each element is a function of its global coordinates. Scaled like a trained model (norms
    near 1, matrices with unit-variance outputs) so that logits are O(1) and a 1e-4 comparison means
    something."""
    seed = int.from_bytes(hashlib.sha256(f"{name}|{int(step)}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in shape)
    if len(shape) == 1:  # RMSNorm weights
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "embed_tokens" in name:
        return rng.standard_normal(shape).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)  # [in, out]: unit-variance outputs


def single_shapes(variant: str) -> dict:
    """{single-process name: shape} of the variant's model on one process (built, not computed)."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(**config_kwargs(variant)))
    return {k: tuple(int(d) for d in p.shape) for k, p in m.state_dict().items()}


def split_actions(cfg) -> dict:
    from paddlenlp.transformers import LlamaForCausalLM

    if cfg.tensor_parallel_degree <= 1:
        return {}
    return LlamaForCausalLM._get_tensor_parallel_mappings(cfg, is_split=True)


def _framework_name(single: str) -> str:
    return single[len("llama."):] if single.startswith("llama.") else single


def set_weights(params: dict, shapes: dict, actions: dict, step: int) -> None:
    """params: {single-process name: local parameter}. Every rank's parameter becomes PaddleNLP's
    split of the single-process tensor for its mp rank."""
    import paddle

    for name, p in params.items():
        full = weight_values(name, shapes[name], step)
        act = actions.get(_framework_name(name))
        local = np.ascontiguousarray(act(full)) if act is not None else full
        assert tuple(local.shape) == tuple(p.shape), (name, local.shape, p.shape)
        p.set_value(paddle.to_tensor(local))


def layout_problems(sd: dict, shapes: dict, actions: dict, mp_rank: int) -> list:
    """Differences between a sharded state dict and the layout PaddleNLP's split actions give
    (``is_column``: the last axis, else axis 0; no action: the whole tensor on every rank)."""
    problems = []
    for key, sw in sorted(sd.items()):
        local = tuple(int(d) for d in sw.local_shape)
        glob = tuple(shapes[key])
        off = [0] * len(glob)
        act = actions.get(_framework_name(key))
        if act is not None:
            axis = len(glob) - 1 if act.keywords["is_column"] else 0
            off[axis] = mp_rank * local[axis]
        for what, got, want in (("global_shape", sw.global_shape, glob), ("global_offset", sw.global_offset, off)):
            if tuple(int(d) for d in got) != tuple(want):
                problems.append(f"{key}: {what} {list(got)} != {list(want)}")
    return problems


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def build_model(variant: str, hcg, pp: int):
    """(model, {single-process name: parameter}, the PaddleNLP config)."""
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    mp = hcg.get_model_parallel_world_size()
    cfg = LlamaConfig(**config_kwargs(variant), tensor_parallel_degree=mp,
                      tensor_parallel_rank=hcg.get_model_parallel_rank())
    if pp == 1:
        model = LlamaForCausalLM(cfg)
        return model, dict(model.named_parameters()), cfg
    import paddle.distributed as dist
    from paddlenlp.transformers import LlamaForCausalLMPipe

    # CPU: PipelineLayer reads ParallelEnv().device_id, which only GPU/XPU/custom devices set
    # (AttributeError: 'ParallelEnv' object has no attribute '_device_id', pp_layers.py:453)
    if not hasattr(dist.ParallelEnv(), "_device_id"):
        dist.ParallelEnv._device_id = 0
    model = LlamaForCausalLMPipe(cfg)
    model._set_pipeline_name_mapping()  # PaddleNLP's own map from pipeline names to single-model names
    to_single = dict(model._pp_to_single_mapping)
    return model, {to_single[k]: p for k, p in model.named_parameters()}, cfg


def run_checks(model, params, out, rank) -> dict:
    """The issue's symptom without the fix, and a refusal on the real model."""
    from dataclasses import replace

    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.models.model_info import build_model_source
    from paddlenlp.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    res = {"rank": rank}
    # 1. the unfixed dict: the export refuses (replicas out of sync), as in issue 11
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out}/raw", "on_error=raise", "trigger.on_train_end=false"])
    handler = CallbackHandler([cb], model, None, None, None)
    args = types.SimpleNamespace(output_dir=f"{out}/raw")
    handler.on_train_begin(args, TrainerState(), TrainerControl())
    try:
        cb.session.export(replace(cb._source, sharded_state_dict=model.sharded_state_dict), 1)
        res["raw_export"] = "exported"
    except Exception as e:
        res["raw_export"] = f"{type(e).__name__}: {e}"
    cb.session.close()
    # 2. marks that contradict the layer: refused, naming the parameter
    source = build_model_source(model, cb.config)
    head = params["lm_head.weight"]
    head.split_axis = 0  # LlamaLMHead and PaddleNLP's split action say 1
    try:
        source.sharded_state_dict()
        res["contradiction"] = "accepted"
    except Exception as e:
        res["contradiction"] = f"{type(e).__name__}: {e}"
    finally:
        head.split_axis = 1
    return res


def main():
    ap = argparse.ArgumentParser()
    for a in ("dp", "mp", "pp"):
        ap.add_argument(f"--{a}", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="fused,unfused")
    ap.add_argument("--checks", action="store_true")
    ns = ap.parse_args()

    import time

    import paddle.distributed as dist
    from paddlenlp.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.models.pipe import single_named
    from paddle_fullparam_callbacks.models.shard_fixes import fix_sharded_state_dict

    hcg = harness.init_fleet(dp=ns.dp, mp=ns.mp, pp=ns.pp)
    rank, mp_rank = dist.get_rank(), hcg.get_model_parallel_rank()
    capture = _Capture()
    logging.getLogger("paddle_fullparam_callbacks").addHandler(capture)
    for i, variant in enumerate(ns.variants.split(",")):
        t0 = time.perf_counter()
        model, params, cfg = build_model(variant, hcg, ns.pp)
        shapes = single_shapes(variant)
        actions = split_actions(cfg)
        set_weights(params, shapes, actions, 1)
        raw = single_named(model)()  # the pipeline model's tensors under single-model names (the package's view)
        fixed, fixes = fix_sharded_state_dict(model, raw)
        report = {
            "variant": variant, "rank": rank, "mp_rank": mp_rank, "stage": hcg.get_stage_id(),
            "params": sorted(params),
            "raw_problems": layout_problems(raw, shapes, actions, mp_rank),
            "fixed_problems": layout_problems(fixed, shapes, actions, mp_rank),
            "fixes": [f.describe() for f in fixes],
            "distributed": sorted(k for k, p in params.items() if p.is_distributed),
        }
        if ns.checks and i == 0:
            print("PNLP_CHECKS " + json.dumps(run_checks(model, params, f"{ns.out}/checks", rank)), flush=True)
        capture.messages.clear()
        overrides = [f"output_dir={ns.out}/{variant.replace(':', '-')}", "trigger.every_n_steps=1", "on_error=raise",
                     "retention.keep_last=0", "export.max_shard_size=48KB"]
        cb = FullParamExportCallback(None, overrides=overrides)
        handler = CallbackHandler([cb], model, None, None, None)
        args = types.SimpleNamespace(output_dir=f"{ns.out}/{variant.replace(':', '-')}")
        state, control = TrainerState(), TrainerControl()
        try:
            handler.on_train_begin(args, state, control)
        except Exception as e:  # refused before the first step (the same on every rank): reported, next variant
            report.update(setup_error=f"{type(e).__name__}: {e}", seconds=round(time.perf_counter() - t0, 2))
            print("PNLP_TP " + json.dumps(report), flush=True)
            dist.barrier()
            continue
        for step in (1, 2):
            set_weights(params, shapes, actions, step)
            state.global_step = step
            handler.on_step_end(args, state, control)
        handler.on_train_end(args, state, control)
        dist.barrier()
        report.update(
            events=cb.events, errors=[str(e) for e in cb.errors],
            files_written_here=[s.files_written_here for s in cb.snapshots],
            warnings=[m for m in capture.messages if "sharded_state_dict says" in m],
            seconds=round(time.perf_counter() - t0, 2),
        )
        print("PNLP_TP " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
