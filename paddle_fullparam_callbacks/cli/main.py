"""``paddle-fullparam``: demo | verify | recipes."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _cmd_verify(ns) -> int:
    from ..export.verify import verify_snapshot

    reports = [verify_snapshot(d, check_hashes=not ns.no_hash) for d in ns.dirs]
    if ns.json:
        payload = reports[0].as_dict() if len(reports) == 1 else {"ok": all(r.ok for r in reports), "snapshots": [r.as_dict() for r in reports]}
        print(json.dumps(payload))
    else:
        for r in reports:
            status = "OK" if r.ok else "DAMAGED"
            print(f"{status}  {r.path}: {r.files} files, {r.tensors} tensors, {r.bytes} bytes")
            for e in r.errors:
                print(f"  - {e}")
    return 0 if all(r.ok for r in reports) else 1


def _cmd_recipes(ns) -> int:
    from ..config.recipes import list_recipes, recipes_dir

    rows = list_recipes()
    if not rows:
        print(f"no recipes found in {recipes_dir()}", file=sys.stderr)
        return 1
    width = max(len(n) for n, _ in rows)
    for name, desc in rows:
        print(f"{name:<{width}}  {desc}")
    return 0


def _cmd_demo(ns) -> int:
    from .demo import run_demo

    return run_demo(output_dir=ns.output_dir, recipe=ns.recipe, overrides=ns.overrides, steps=ns.steps)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paddle-fullparam", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a tiny Llama on CPU with the PaddleFormers Trainer, exporting HF snapshots")
    d.add_argument("--output-dir", default="demo_output", help="where the trainer and the snapshots write (default: demo_output)")
    d.add_argument("--recipe", default="demo_tiny_llama", help="recipe name or path (default: demo_tiny_llama)")
    d.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    d.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    d.set_defaults(func=_cmd_demo)

    v = sub.add_parser("verify", help="check snapshot directories against their manifest and index")
    v.add_argument("dirs", nargs="+")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--no-hash", action="store_true", help="skip sha256 (sizes and headers only)")
    v.set_defaults(func=_cmd_verify)

    r = sub.add_parser("recipes", help="list the bundled recipes")
    r.set_defaults(func=_cmd_recipes)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    ns = build_parser().parse_args(argv)
    from ..config.schema import ConfigError

    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"paddle-fullparam: bad recipe value: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
