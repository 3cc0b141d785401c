"""Launched part of ``bench/real_size.py``: one rank of the two-rank (mp2) export.

    python -m paddle.distributed.launch --nproc_per_node 2 bench/_real_size_ranks.py --dims JSON --out DIR [--reps N]

Not meant to be run by hand. Each rank: ``harness.init_fleet(mp=2)`` (the gloo-safe group creation of
CPU_CLUSTER.md), PaddleFormers' ``LlamaForCausalLM`` at ``--dims`` with ``tensor_model_parallel_size=2`` in
bfloat16 (its own tensor-parallel layers: ``VocabParallelEmbedding``, column- and row-parallel Linears, the head
split over the vocabulary; each rank builds and holds its half), a callback driven as the Trainer drives it
(``on_train_begin`` inside the gloo-safe group creation, then ``on_save``). Around each ``on_save``: the
kernel's count of the bytes this rank's sockets received and sent (``ss -tinpH``, ``assembler_ranks.tcp_counts``),
sampled after a barrier right before the call and right after it. The plan's prediction of the same
(``plan/prediction.predict``: what ``paddle-fullparam plan --model`` says, from the shapes alone). After each
export every rank checks its own half: each of its slices read back from the snapshot's files at the offset
Paddle's sharded state dict gives it, and compared with its parameter (the HF layout by ``_real_size``'s rule).
Prints ``RSRANKS {json}``. The first snapshot stays for the parent (``verify``, ``config.json``); later ones
are removed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "multirank"), str(HERE)]

import _real_size as R  # noqa: E402
import assembler_ranks as A  # noqa: E402  (the kernel's byte counts)
import harness  # noqa: E402


def build(d: dict):
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.set_default_dtype("bfloat16")
    model = LlamaForCausalLM(LlamaConfig(**d, tensor_model_parallel_size=2))
    model.eval()
    return model


def predicted(d: dict, rank: int, max_shard: str) -> dict:
    from paddle_fullparam_callbacks.config.sizes import parse_size
    from paddle_fullparam_callbacks.plan.prediction import predict
    from paddle_fullparam_callbacks.plan.topology import plan_topology

    topo = plan_topology([("data", 1), ("pipe", 1), ("sharding", 1), ("sep", 1), ("expert", 1), ("model", 2)])
    p = predict(R.shapes(d), "bfloat16", topo, parse_size(max_shard))
    return {"snapshot_bytes": p["snapshot_bytes"], "files": p["files"], **p["ranks"][rank]}


def check_own_half(model, snapshot: Path) -> dict:
    """Each slice this rank holds, read back from the files at its offset, against the parameter's bytes."""
    import numpy as np

    from _real_size_checks import param_view

    tensors = R.snapshot_tensors(snapshot)
    wrong, checked, nbytes = [], 0, 0
    for key, sw in model.sharded_state_dict().items():
        local = R.hf_array(key, param_view(sw.local_tensor))
        offset = tuple(sw.global_offset)[::-1] if R.LINEAR.search(key) else tuple(sw.global_offset)
        fname, dtype, shape, b, _ = tensors[key]
        if dtype != "BF16":
            wrong.append(f"{key}: {dtype}")
            continue
        full = np.memmap(snapshot / fname, dtype=np.uint16, mode="r", offset=b, shape=tuple(shape))
        index = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        rows = max(1, R.CHUNK // max(1, local.itemsize * (local.shape[1] if local.ndim == 2 else local.size)))
        same = all(np.array_equal(full[index][r:r + rows], local[r:r + rows]) for r in range(0, local.shape[0], rows))
        del full
        checked += 1
        nbytes += local.nbytes
        if not same:
            wrong.append(key)
    return {"slices": checked, "bytes": nbytes, "wrong": wrong[:10], "ok": not wrong}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-shard-size", default="5GB")
    ns = ap.parse_args()
    d = json.loads(ns.dims)

    import paddle.distributed as dist

    import _common as C
    from _real_size_single import Driver

    C.quiet_logs()
    harness.init_fleet(mp=2)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    model = build(d)
    report = {"rank": rank, "build_seconds": round(time.perf_counter() - t0, 1), "rss_with_model_bytes": C.rss_bytes(),
              "local_bytes": C.parameter_bytes(model), "predicted": predicted(d, rank, ns.max_shard_size), "reps": []}
    drv = Driver(ns.out, [f"export.max_shard_size={ns.max_shard_size}"])
    with harness.gloo_safe_group_creation():  # the export's own groups are made at on_train_begin
        drv.begin(model)
    ctx = drv.cb.session.ctx
    for rep in range(ns.reps):
        ctx.barrier()
        k0 = A.tcp_counts(os.getpid())
        with C.CpuShare() as cpu:
            t0 = time.perf_counter()
            info = drv.save(rep + 1, model)
            seconds = time.perf_counter() - t0
        k1 = A.tcp_counts(os.getpid())
        routes = drv.cb.session._prepared.routes
        own = routes.traffic.get(rank) if routes is not None else None
        row = {"seconds": round(seconds, 4), "kernel": A.tcp_delta(k0, k1),
               "plan_received": own.received if own else 0, "plan_sent": own.sent if own else 0,
               "files_written_here": info.files_written_here, "snapshot": str(info.path),
               "timings": {k: round(v, 4) for k, v in info.timings.items()}, "cpu": cpu.as_dict()}
        ctx.barrier()
        row["check"] = check_own_half(model, Path(info.path))
        report["reps"].append(row)
        ctx.barrier()
        if rep and rank == 0:
            shutil.rmtree(info.path)
    drv.end()
    print("RSRANKS " + json.dumps(report), flush=True)
    ctx.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the process groups' teardown order across ranks is not this benchmark's subject (as pipe_job.py)


if __name__ == "__main__":
    main()
