"""A 4-rank (dp2 x mp2) exporting job for the crash loop: real fleet topology and parallel layers
(tests/multirank/harness.py), one rank killed at a named point (PFC_FAULT_POINT, PFC_FAULT_RANK).
Like crash_job.py: re-exports the newest committed step, then three new ones."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))

import harness  # noqa: E402


def main():
    out = Path(sys.argv[1])
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession, ModelSource
    from paddle_fullparam_callbacks.trainer.topology import build_context

    hcg = harness.init_fleet(dp=2, mp=2)
    model = harness.TinyParallelLlama(hcg=hcg)
    ctx = build_context()
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=2KB", "retention.keep_last=2"])
    session = ExportSession(cfg, out, ctx=ctx)
    session.start(resume=True)  # each run is the restart of the one killed before it
    source = ModelSource(sharded_state_dict=lambda: harness.sharded_state_dict(model))
    latest = ctx.all_gather_object((out / "latest").read_text().strip() if (out / "latest").exists() else None)[0]
    start = int(re.search(r"(\d+)$", latest).group(1)) if latest else 1
    for step in [start, start + 1, start + 2]:
        harness.perturb(model, step)
        session.export(source, step)
    print("DONE", os.environ.get("PADDLE_TRAINER_ID"), flush=True)


if __name__ == "__main__":
    main()
