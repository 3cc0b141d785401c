"""Expert parallelism on real ranks: experts held whole by different ranks, exported by the real callback.

Launched, one launch per topology with every case inside it::

    python -m paddle.distributed.launch --nproc_per_node 2 ep_job.py --dp 2 --cases ernie-dp --out DIR/dp2
    python -m paddle.distributed.launch --nproc_per_node 2 ep_job.py --mp 2 --cases ernie-mp --out DIR/mp2
    python -m paddle.distributed.launch --nproc_per_node 4 ep_job.py --dp 2 --mp 2 \\
        --cases ernie-dp,ernie-mp,toy-dp,toy-mp --out DIR/dp2xmp2

Cases (each into ``DIR/<case>/``):

``ernie-<group>``: PaddleFormers' real ``Ernie4_5_MoeForCausalLM`` (the zoo's tiny config: 2 decoder
layers, layer 1 a MoE layer with 4 experts and a shared expert) built with ``moe_group=<group>``
(``dp``: the data-parallel ranks hold different experts; ``mp``: the tensor-parallel ranks do), so
``model.layers.1.mlp.experts[i]`` is None on every rank but the owner's. Every shard gets
deterministic values by name (``pipe_job.set_trained_values``: the same on every rank that holds a
replica), every rank dumps its sharded state dict (``dump/``), and two callbacks export step 1 through
the trainer's callback handler: Hugging Face format (``hf/``, PaddleFormers' own mapping) and
``export.format=paddle_safetensors`` (``paddle/``, Paddle names, no mapping); a third one the FP8 snapshot
(``fp8/``, ``export.quantization=fp8``: each expert quantized whole by the rank that writes it).

``toy-<axis>``: the harness's tensor-parallel ``TinyParallelLlama`` with per-rank experts added:
``model.layers.N.mlp.experts.E.weight`` (Paddle [in, out], 4 per layer) held whole by the owning rank
of the expert axis (``dp``: data, ``mp``: model; the config says so as PaddleFormers' ``moe_group``
would), reported whole by ``sharded_state_dict()``. Steps 1 and 2 with the harness's deterministic
"optimizer steps" between them, exported in HF format with an explicit mapping (Linear weights and
experts transposed); dumps per step in ``dump/step-N``.

Prints ``EP {json}`` per case and rank (experts held, the topology plan the callback used, files
written, errors) and writes them to ``DIR/report-rank<N>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "zoo"), str(HERE.parent)]

import harness  # noqa: E402

NUM_EXPERTS = 4  # per MoE layer, both models
FP8 = ["export.quantization=fp8", "export.quantization_block=[16,16]"]
COMMON = ["retention.keep_last=0", "on_error=raise", "export.max_shard_size=64KB"]
TOY_EXPERT_AOA = "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.weight^T -> model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.weight"


def trainer_args(out: Path, dp: int, mp: int):
    """What the callback reads from the trainer's TrainingArguments (PaddleFormers' names)."""
    return types.SimpleNamespace(output_dir=str(out), sharding="", data_parallel_size=dp,
                                 tensor_model_parallel_size=mp, pipeline_model_parallel_size=1)


def fire(callbacks, model, args, steps, before_step) -> None:
    """The trainer's event sequence through its own CallbackHandler: begin, step ends, end.
    ``on_train_begin`` creates the groups the plan needs (collectively): on CPU/gloo that needs
    the harness's group-creation fix; GPU/NCCL jobs do not."""
    from paddleformers.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    handler = CallbackHandler(callbacks, model, None, None, None)
    state, control = TrainerState(), TrainerControl()
    with harness.gloo_safe_group_creation():
        handler.on_train_begin(args, state, control)
    for step in steps:
        before_step(step)
        state.global_step = step
        handler.on_step_end(args, state, control)
    handler.on_train_end(args, state, control)


def cb_report(cb) -> dict:
    ctx = cb.session.ctx if cb.session is not None else None
    topo = getattr(ctx, "topology", None)
    return {
        "events": list(cb.events), "errors": list(cb.errors),
        "snapshots": [str(s.path) for s in cb.snapshots if s.path is not None],
        "files_written_here": [s.files_written_here for s in cb.snapshots],
        "topology": topo.as_dict() if topo is not None else None,
        "mesh": [list(r) for r in ctx.mesh.rows] if topo is not None else None,
    }


def axis_rank(hcg, axis: str) -> tuple:
    if axis == "dp":
        return hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size()
    return hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()


# ----------------------------------------------------------------------------------------------
# PaddleFormers' Ernie4_5_Moe
# ----------------------------------------------------------------------------------------------


def ernie_case():
    import pipe_job

    return pipe_job.PipeCase("ernie4_5_moe", "pf-ernie4_5_moe", "", forward=False)


def run_ernie(group: str, out: Path, hcg, dp: int, mp: int) -> dict:
    import paddle

    import pipe_job
    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.trainer.topology import expert_axes_of
    from paddleformers.transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    case = ernie_case()
    mp_rank = hcg.get_model_parallel_rank()
    rep = {}
    try:
        config = Ernie4_5_MoeConfig(**dict(pipe_job.plain_kwargs(case), moe_group=group, tensor_model_parallel_size=mp,
                                            tensor_parallel_rank=mp_rank))
        paddle.seed(0)
        with harness.gloo_safe_group_creation():
            model = Ernie4_5_MoeForCausalLM(config)
    except Exception as e:  # recorded: the test says which configuration does not build here
        rep["build_error"] = pipe_job.where(e)
        return rep
    rep["experts_held"] = {str(i): [e for e, x in enumerate(layer.mlp.experts) if x is not None]
                           for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    rep["moe_rank"], rep["moe_world_size"] = int(model.config.moe_rank), int(model.config.moe_world_size)
    rep["expert_axes"] = list(expert_axes_of(model))
    rep["values_set"] = pipe_job.set_trained_values(case, model, mp, mp_rank)
    harness.dump_shards(model.sharded_state_dict(), out / "dump")
    callbacks = [FullParamExportCallback(None, overrides=[f"output_dir={out / 'hf'}", "trigger.every_n_steps=1", *COMMON]),
                 FullParamExportCallback(None, overrides=[f"output_dir={out / 'paddle'}", "trigger.every_n_steps=1",
                                                          "export.format=paddle_safetensors", *COMMON]),
                 FullParamExportCallback(None, overrides=[f"output_dir={out / 'fp8'}", "trigger.every_n_steps=1",
                                                          *FP8, *COMMON])]
    try:
        fire(callbacks, model, trainer_args(out, dp, mp), [1], lambda step: None)
    except Exception as e:  # the package reports a refused plan or export on every rank alike
        rep["export_error"] = f"{type(e).__name__}: {e}"
    rep["hf"], rep["paddle"], rep["fp8"] = (cb_report(cb) for cb in callbacks)
    return rep


# ----------------------------------------------------------------------------------------------
# The harness's tiny tensor-parallel Llama with per-rank experts
# ----------------------------------------------------------------------------------------------


class ToyConfig:
    """The little a model config tells the exporter here: where its experts are (PaddleFormers'
    ``moe_group``, as text)."""

    def __init__(self, moe_group: str):
        self.moe_group = moe_group
        self.tie_word_embeddings = False

    def to_dict(self, saving_file=False) -> dict:
        return {"model_type": "expert_toy", "moe_group": self.moe_group, "num_experts": NUM_EXPERTS}


def expert_shape(dims) -> tuple:
    return (dims["hidden"], dims["inter"])  # Paddle [in, out]


def build_toy(hcg, axis: str):
    """TinyParallelLlama plus ``NUM_EXPERTS`` experts per decoder layer, the ones this rank owns
    on ``axis`` (None for the others, as PaddleFormers' MoE layers hold them)."""
    import paddle
    from paddle import nn
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    class Expert(nn.Layer):
        def __init__(self, shape):
            super().__init__()
            self.weight = self.create_parameter(shape=list(shape), dtype=paddle.get_default_dtype())

    model = harness.TinyParallelLlama(hcg=hcg)
    model.config = ToyConfig("dp" if axis == "dp" else "mp")
    r, n = axis_rank(hcg, axis)
    per_rank = NUM_EXPERTS // n
    shape = expert_shape(model.dims)
    model.expert_params = {}
    for i in model.layer_ids:
        experts = nn.LayerList([Expert(shape) if e // per_rank == r else None for e in range(NUM_EXPERTS)])
        model.model.layers[str(i)].mlp.experts = experts
        for e, layer in enumerate(experts):
            if layer is not None:
                model.expert_params[f"model.layers.{i}.mlp.experts.{e}.weight"] = layer.weight
    assert set(dict(model.named_parameters())) == set(model.param_specs) | set(model.expert_params)

    def sharded_state_dict():
        sd = harness.sharded_state_dict(model)
        for k, p in model.expert_params.items():  # whole, on the owner (and its replicas) only
            sd[k] = ShardedWeight(k, p, tuple(p.shape), tuple(p.shape), (0,) * len(p.shape))
        return sd

    model.sharded_state_dict = sharded_state_dict
    return model


def perturb_toy(model, step: int) -> None:
    """An "optimizer step": dense shards from the harness's layout table, experts whole."""
    import paddle

    harness.perturb(model, step)
    for k, p in model.expert_params.items():
        p.set_value(paddle.to_tensor(harness.expected_global(k, tuple(p.shape), step)))


def run_toy(axis: str, out: Path, hcg, dp: int, mp: int) -> dict:
    import export_job
    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.trainer.topology import expert_axes_of

    model = build_toy(hcg, axis)
    rep = {"experts_held": sorted(model.expert_params), "expert_axes": list(expert_axes_of(model))}
    aoa = json.dumps([*export_job.AOA, TOY_EXPERT_AOA])
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out / 'hf'}", "trigger.every_n_steps=1",
                                                  "export.aoa=" + aoa, "retention.keep_last=0", "on_error=raise",
                                                  "export.max_shard_size=3KB"])

    def step(n):
        perturb_toy(model, n)
        harness.dump_shards(model.sharded_state_dict(), out / "dump" / f"step-{n}")

    try:
        fire([cb], model, trainer_args(out, dp, mp), [1, 2], step)
    except Exception as e:
        rep["export_error"] = f"{type(e).__name__}: {e}"
    rep["hf"] = cb_report(cb)
    return rep


# ----------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--mp", type=int, default=1)
    ap.add_argument("--cases", required=True, help="comma-separated: ernie-dp, ernie-mp, toy-dp, toy-mp")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()

    import paddle.distributed as dist

    hcg = harness.init_fleet(dp=ns.dp, mp=ns.mp)
    from paddle_fullparam_callbacks.cli.demo import quiet_framework_logs

    quiet_framework_logs()
    out = Path(ns.out)
    rank = dist.get_rank()
    reports = []
    for case in ns.cases.split(","):
        kind, axis = case.split("-")
        t0 = time.perf_counter()
        run = run_ernie if kind == "ernie" else run_toy
        rep = {"rank": rank, "case": case, "dp_rank": hcg.get_data_parallel_rank(), "mp_rank": hcg.get_model_parallel_rank(),
               **run(axis, out / case, hcg, ns.dp, ns.mp)}
        dist.barrier()
        rep["seconds"] = round(time.perf_counter() - t0, 2)
        print("EP " + json.dumps(rep), flush=True)
        reports.append(rep)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"report-rank{rank}.json").write_text(json.dumps(reports, indent=1))
    dist.barrier()
    # see pipe_job.launched: leave without the process groups' and stores' destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
