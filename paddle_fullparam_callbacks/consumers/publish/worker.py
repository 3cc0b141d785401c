"""The publishing process: ``python -m paddle_fullparam_callbacks.consumers.publish.worker SPEC.json OUTPUT.json``.

The runner (``consumers/runner.py``) starts it, at lower priority, in a process group of its own; it
publishes one snapshot (``engine.publish_one``) and writes what it did to OUTPUT (JSON), or prints the
store's error and exits 1. SIGTERM (the training ended, or a timeout) stops it at once: what it had
uploaded stays on the store, its journal says which multipart upload to resume, and the next
publication of the snapshot finishes it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys


def main(argv) -> int:
    spec_path, output = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))  # parts in flight are the store's to forget

    from .engine import publish_one
    from .store import StoreError
    from .upload import LocalFileChanged

    try:
        result = publish_one(spec)
    except (StoreError, LocalFileChanged, OSError, ValueError) as e:
        print(f"publish failed: {type(e).__name__}: {e}", file=sys.stderr)
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 1
    tmp = f"{output}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
