"""A job whose disk fills up: RLIMIT_FSIZE caps file sizes (as a full disk or a quota would),
an export fails, training goes on (on_error=warn), then space comes back and the next export works.
Prints one JSON line with what happened."""
from __future__ import annotations

import json
import resource
import signal
import sys
from pathlib import Path


def main():
    out = Path(sys.argv[1])
    on_error = sys.argv[2]
    import paddle

    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.export import ExportError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    paddle.seed(0)
    layer = paddle.nn.Sequential(paddle.nn.Linear(64, 256), paddle.nn.Linear(256, 64))
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out}", f"on_error={on_error}", "export.aoa=[]",
                                                  "trigger.every_n_steps=1"])
    # a trainer-like sequence of events (the model is plain Paddle; no framework needed)
    import types

    args, state, control = types.SimpleNamespace(output_dir=str(out)), types.SimpleNamespace(global_step=0, log_history=[]), None
    cb.on_train_begin(args, state, control, model=layer)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    events = []
    for step in (1, 2, 3):
        state.global_step = step
        if step == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))  # the disk is full
        if step == 3:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
        try:
            cb.on_step_end(args, state, control, model=layer)
            events.append(f"step {step}: ok")
        except ExportError as e:
            events.append(f"step {step}: raised")
            print(json.dumps({"events": events, "errors": cb.errors, "raised": str(e)}))
            return
    print(json.dumps({"events": events, "errors": cb.errors, "snapshots": [s.name for s in cb.snapshots]}))


if __name__ == "__main__":
    main()
