"""One rank of ``paddle-fullparam selfcheck`` (started by ``paddle.distributed.launch`` as a script:
absolute imports only).

    python -m paddle.distributed.launch ... job.py --device TYPE --out DIR --mp M --pp P --dp D --budget SIZE

Forms the hybrid topology with ``fleet.init`` on the device (its own backend: NCCL, XCCL, BKCL, gloo),
builds the model (``model.py``), writes its shards to ``DIR/shards`` with Paddle's own device-to-host
copy (independent of the export's), exports twice through the package (``keep`` and ``bfloat16``),
and prints one line ``SELFCHECK {json}``: the export's figures and the device's allocation peak.
The parent (``__init__.py``) checks the snapshots.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path


def _device_stats(device: str):
    """(reset, allocated, peak) functions of this rank's device, or None on CPU (no allocator statistics)."""
    import paddle

    if device == "cpu":
        return None
    place = paddle.framework._current_expected_place()
    name = f"{device}:{place.get_device_id()}"
    return (lambda: paddle.device.reset_max_memory_allocated(name),
            lambda: paddle.device.memory_allocated(name), lambda: paddle.device.max_memory_allocated(name))


def _fleet(device: str, mp: int, pp: int, dp: int):
    import paddle
    from paddle.distributed import fleet

    from paddle_fullparam_callbacks.trainer.host_groups import fresh_store_per_gloo_group

    paddle.set_device(device)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp}
    if pp > 1:
        strategy.pipeline_configs = {"accumulate_steps": 1, "micro_batch_size": 1}
    if device == "cpu":
        with fresh_store_per_gloo_group():  # see host_groups.py: Paddle's gloo groups collide otherwise
            fleet.init(is_collective=True, strategy=strategy)
    else:
        fleet.init(is_collective=True, strategy=strategy)
    return fleet.get_hybrid_communicate_group()


def _dump_shards(model, out: Path, rank: int) -> None:
    """This rank's shards, copied to the host by Paddle itself (``.numpy()``), with their offsets."""
    import numpy as np

    arrays, meta = {}, {}
    for i, (key, sw) in enumerate(sorted(model.sharded_state_dict().items())):
        arrays[f"a{i}"] = sw.local_tensor.numpy()
        meta[f"a{i}"] = [key, list(sw.global_offset), list(sw.global_shape)]
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank-{rank}.npz", **arrays)
    (out / f"rank-{rank}.json").write_text(json.dumps(meta))


def _export(model, out: Path, dtype: str, budget: str, step: int, stats) -> dict:
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export.session.session import ExportSession
    from paddle_fullparam_callbacks.export.source import ModelSource
    from paddle_fullparam_callbacks.trainer.topology import build_context

    cfg = load_config(None, [f"output_dir={out}", "export.format=paddle_safetensors", f"export.dtype={dtype}",
                             f"export.device_memory_budget={budget}", "export.max_shard_size=1MB",
                             "export.copy_tokenizer=false", "trigger.on_train_end=false"])
    ctx = build_context()
    session = ExportSession(cfg, out, ctx=ctx)
    session.start()
    source = ModelSource(sharded_state_dict=model.sharded_state_dict, framework="selfcheck")
    try:
        session.prepare(source)
        base = None
        if stats is not None:
            stats[0]()
            base = stats[1]()
        t0 = time.perf_counter()
        info = session.export(source, step)
        seconds = time.perf_counter() - t0
        peak = None if stats is None else stats[2]() - base
    finally:
        session.close()
    return {"dtype": dtype, "snapshot": str(info.path), "seconds": seconds, "bytes": info.bytes,
            "tensors": info.num_tensors, "device_peak": peak, "files_written_here": info.files_written_here}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--device", "--out", "--budget"):
        ap.add_argument(name, required=True)
    for name in ("--mp", "--pp", "--dp"):
        ap.add_argument(name, type=int, required=True)
    ns = ap.parse_args(argv)
    report = {"rank": None}
    try:
        import paddle
        import paddle.distributed as dist

        t0 = time.perf_counter()
        hcg = _fleet(ns.device, ns.mp, ns.pp, ns.dp)
        rank = report["rank"] = dist.get_rank()
        report.update(world=dist.get_world_size(), fleet_s=time.perf_counter() - t0,
                      place=str(paddle.framework._current_expected_place()),
                      backend=str(getattr(dist.collective, "_default_backend", "") or ""))
        from paddle_fullparam_callbacks.cli.selfcheck.model import build

        model = build(hcg)
        report["params_on"] = sorted({str(p.place) for p in model.parameters()})
        _dump_shards(model, Path(ns.out) / "shards", rank)
        stats = _device_stats(ns.device)
        report["exports"] = [_export(model, Path(ns.out) / "snapshots", dtype, ns.budget, step, stats)
                             for step, dtype in ((1, "keep"), (2, "bfloat16"))]
    except BaseException as e:  # reported to the parent, which says FAIL with it
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-4000:]
    print("SELFCHECK " + json.dumps(report), flush=True)
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
