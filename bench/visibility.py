"""Cost of the start-time proof that every rank sees the output directory (``commit/visibility.py``).

Run (a few minutes: each repetition is a real 4-rank training job through the PaddleFormers Trainer)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/visibility.py            # -> bench/results/visibility.json
    $PY bench/visibility.py --reps 5

Each repetition launches ``tests/multirank/nodes_job.py`` twice: as one node of 4 ranks and as two
"nodes" of 2 ranks (two ``--nnodes 2`` launches, each in its own working directory, one shared
absolute output directory). Every rank records how long its part of the proof took: reading the
coordinator's token and creating and removing its own file (``visibility_files_s``), and the one
exchange of the results (``visibility_exchange_s``, which includes waiting for the slowest rank).
The figures are medians over ranks and repetitions; on a cluster the file part is a few network
filesystem round trips and the exchange one small all-gather.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "multirank")]
JOB = ROOT / "tests" / "multirank" / "nodes_job.py"
RESULT_PATH = C.RESULTS_DIR / "visibility.json"


def _ranks(results) -> list:
    return [obj["start_timings"] for r in results for _, obj in r.tagged("NODES")]


def main() -> int:
    import harness
    from nodes import run_two_nodes

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ns = ap.parse_args()
    rows = {"one_node_4_ranks": [], "two_nodes_2x2_ranks": []}
    with tempfile.TemporaryDirectory(prefix="pfc_vis_") as d:
        work = Path(d)
        for rep in range(ns.reps):
            C.wait_quiet()
            one = harness.run_launch(JOB, ["--snaps", work / f"one{rep}", "--trainer-dir", work / f"t{rep}"], nproc=4,
                                     timeout=300)
            assert one.rc == 0, one.describe()
            rows["one_node_4_ranks"] += _ranks([one])
            nodes = [work / f"n{rep}a", work / f"n{rep}b"]
            for n in nodes:
                n.mkdir()
            two = run_two_nodes(JOB, ["--snaps", work / f"two{rep}", "--trainer-dir", "trainer"], nodes, timeout=300)
            assert all(r.rc == 0 for r in two), "\n".join(r.describe() for r in two)
            rows["two_nodes_2x2_ranks"] += _ranks(two)
            for p in [work / f"one{rep}", work / f"two{rep}", *nodes]:
                shutil.rmtree(p, ignore_errors=True)
    result = {"benchmark": "visibility",
              "reps": ns.reps}
    for name, ranks in rows.items():
        files = [r["visibility_files_s"] for r in ranks]
        exchange = [r["visibility_exchange_s"] for r in ranks]
        result[name] = {"ranks_measured": len(ranks),
                        "files_ms_median": round(1e3 * C.median(files), 2), "files_ms_max": round(1e3 * max(files), 2),
                        "exchange_ms_median": round(1e3 * C.median(exchange), 2),
                        "exchange_ms_max": round(1e3 * max(exchange), 2)}
    result["notes"] = ["cost of the proof on each rank, once per job at on_train_begin; the token file is written "
                       "by the coordinator inside its start checks (not timed separately: one small fsynced file)"]
    C.write_result(RESULT_PATH, result)
    print({k: v for k, v in result.items() if k not in ("machine",)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
