"""Fuzzing ``verify`` at scale: the generators of ``tests/unit/test_pf_verify_fuzz.py``, more cases.

Run (about 10 ms a case on 2 cores; no Paddle needed, any environment with hypothesis)::

    PY=$(scripts/env.sh paddleformers)
    PYTHONPATH=. $PY bench/verify_fuzz.py                      # 10000 cases -> bench/results/verify_fuzz.json
    PYTHONPATH=. $PY bench/verify_fuzz.py --cases 50000 --out /tmp/verify_fuzz.json

Each case mutates a copy of a valid snapshot (or of an output directory with ``latest``/``best``)
and verifies it: bytes flipped, inserted or cut; header lengths; JSON values replaced, deleted or
re-keyed at random paths; deep nesting; duplicate keys; names leaving the snapshot; symbolic
links, FIFOs, directories. The cases are split between the generators in the proportions of the
unit tests. A case counts as a traceback when verify raises, hangs, or (through the command)
prints anything but one JSON object; as an escape when a file outside the checked directory is
opened. ``verify_fuzz_tracebacks`` and ``verify_fuzz_escapes`` must be 0.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "bench"))

import _common as C  # noqa: E402
import hypothesis  # noqa: E402

import test_pf_verify_fuzz as F  # noqa: E402


def run(total: int) -> dict:
    env = F.new_env()
    weights = {g[0]: g[3] for g in F.GENERATORS}
    counts = {n: total * w // sum(weights.values()) for n, w in weights.items()}
    counts[F.GENERATORS[0][0]] += total - sum(counts.values())
    result = {"by_generator": {}, "failures": []}
    start = time.perf_counter()
    try:
        for name, _, runner, _ in F.GENERATORS:
            row = {"cases": 0, "tracebacks": 0, "escapes": 0, "damaged": 0, "generator_errors": 0}

            def on_case(ms, runner=runner, row=row, name=name):
                row["cases"] += 1
                try:
                    report = runner(env, ms)
                    ok = report["ok"] if isinstance(report, dict) else report.ok
                    row["damaged"] += not ok
                except F.Escaped as e:
                    row["escapes"] += 1
                    _keep(result, name, ms, str(e))
                except F.MutationFailed as e:  # the generator's own bug: verify never ran
                    row["generator_errors"] += 1
                    _keep(result, name, ms, str(e))
                except Exception:  # noqa: BLE001 - counted, that is the point
                    row["tracebacks"] += 1
                    _keep(result, name, ms, traceback.format_exc(limit=-3))

            F.run_generator(env, name, counts[name], on_case)
            result["by_generator"][name] = row
    finally:
        shutil.rmtree(env.base, ignore_errors=True)
    rows = result["by_generator"].values()
    return {
        "verify_fuzz_cases": sum(r["cases"] for r in rows),
        "verify_fuzz_tracebacks": sum(r["tracebacks"] for r in rows),
        "verify_fuzz_escapes": sum(r["escapes"] for r in rows),
        "verify_fuzz_damaged": sum(r["damaged"] for r in rows),
        "generator_errors": sum(r["generator_errors"] for r in rows),
        "seconds": round(time.perf_counter() - start, 1),
        **result,
        "hypothesis": hypothesis.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _keep(result: dict, name: str, ms, text: str) -> None:
    if len(result["failures"]) < 10:
        result["failures"].append({"generator": name, "mutations": repr(ms)[:2000], "error": text[-3000:]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the tiny mode (bench/_common.py): 44 cases, a few of every generator
    ap.add_argument("--cases", type=int, default=C.tiny(10_000, 44), help="total number of cases (default 10000)")
    ap.add_argument("--out", default=str(C.RESULTS_DIR / "verify_fuzz.json"), help="where the JSON goes")
    ns = ap.parse_args()
    out = run(ns.cases)
    C.write_json(Path(ns.out), out)
    print(json.dumps({k: v for k, v in out.items() if k.startswith("verify_fuzz") or k == "seconds"}))
    return 0 if out["verify_fuzz_tracebacks"] == out["verify_fuzz_escapes"] == out["generator_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
