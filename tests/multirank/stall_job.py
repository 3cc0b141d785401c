"""4 ranks (dp2 x mp2, real fleet groups and parallel layers) exporting with export.timeout_s:
one rank is stopped (SIGSTOP, PFC_FAULT_SIGNAL=STOP at PFC_FAULT_POINT on PFC_FAULT_RANK) inside
an export; the others must notice within the timeout and end the job."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


def main():
    out, timeout = Path(sys.argv[1]), sys.argv[2]
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession, ModelSource
    from paddle_fullparam_callbacks.trainer.topology import build_context

    hcg = harness.init_fleet(dp=2, mp=2)
    model = harness.TinyParallelLlama(hcg=hcg)
    ctx = build_context()
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=2KB", f"export.timeout_s={timeout}"])
    session = ExportSession(cfg, out, ctx=ctx)
    session.start()
    source = ModelSource(sharded_state_dict=lambda: harness.sharded_state_dict(model))
    for step in (1, 2):
        harness.perturb(model, step)
        print("EXPORT " + json.dumps({"rank": ctx.rank, "step": step, "time": time.time()}), flush=True)
        session.export(source, step)
    print("DONE", os.environ.get("PADDLE_TRAINER_ID"), flush=True)


if __name__ == "__main__":
    main()
