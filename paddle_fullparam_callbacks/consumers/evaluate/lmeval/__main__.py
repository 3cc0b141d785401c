"""``python -m paddle_fullparam_callbacks.consumers.evaluate.lmeval run SNAPSHOT --output FILE --spec JSON`` (the
evaluator, ``run.py``) | ``probe --spec JSON`` (the start's proof, ``probe.py``). The spec is ``spec.build_spec``'s."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_fullparam_callbacks.consumers.evaluate.lmeval",
                                 description="The bundled lm-evaluation-harness evaluator of paddle_fullparam_callbacks.")
    sub = ap.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="score one snapshot")
    run.add_argument("snapshot")
    run.add_argument("--output", default=None, help="write the JSON result here too")
    run.add_argument("--spec", required=True, help="the evaluator's spec (JSON)")
    probe = sub.add_parser("probe", help="the start's proof: the harness, the tasks, their data files")
    probe.add_argument("--spec", required=True)
    ns = ap.parse_args(argv)
    if ns.what == "probe":
        from .probe import probe as run_probe

        print(json.dumps(run_probe(json.loads(ns.spec))), flush=True)
        return 0
    from .run import main as run_main

    return run_main(ns.snapshot, ns.output, ns.spec)


if __name__ == "__main__":
    sys.exit(main())
