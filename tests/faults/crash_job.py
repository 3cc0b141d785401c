"""One training job's exports, killed (SIGKILL) at a named point by ``PFC_FAULT_POINT``.

    PFC_FAULT_POINT=rename@2 python crash_job.py OUT

A small plain-Paddle model (no framework import: fast), one safetensors file per tensor so
that per-tensor and per-block points occur several times. The job first re-exports the newest
committed step (as a resumed job does), then three new steps with an eval metric, keep_last=2 and
keep_best=1, so that commit, replace, pointers, best and retention all run.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    import paddle

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession, ModelSource

    paddle.seed(0)
    layer = paddle.nn.Sequential(paddle.nn.Linear(64, 128), paddle.nn.Linear(128, 64), paddle.nn.LayerNorm(64))
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=20KB", "export.max_pending_bytes=64KB",
                             "retention.keep_last=2", "retention.keep_best=1", "retention.metric=eval_loss"])
    session = ExportSession(cfg, out)
    session.start(resume=True)  # each run is the restart of the one killed before it
    source = ModelSource(sharded_state_dict=layer.sharded_state_dict, hf_config={"architectures": ["Toy"], "model_type": "toy"})
    latest = (out / "latest").read_text().strip() if (out / "latest").exists() else None
    start = int(re.search(r"(\d+)$", latest).group(1)) if latest else 1
    for step in [start, start + 1, start + 2, start + 3]:
        with paddle.no_grad():
            for p in layer.parameters():
                p.set_value(paddle.full(p.shape, float(step), p.dtype))
        session.export(source, step, metrics={"eval_loss": float((step * 7) % 5)}, reason="crash-test")
    print(json.dumps({"done": True, "last": start + 3}))


if __name__ == "__main__":
    main()
