"""Where ``paddle-fullparam convert``'s CPU time goes, stage by stage, sampled by py-spy: this tree against another.

Run (py-spy: the paddleformers environment has it, next to its python; a few minutes)::

    git archive <commit> | tar -x -C /tmp/before             # the tree to compare with
    PY=$(scripts/env.sh paddleformers)
    $PY bench/profile_convert.py --py-spy $(dirname $PY)/py-spy --before /tmp/before
        # -> bench/results/profile_convert.json

The checkpoint is ``bench/convert.py``'s (the 673 MB Llama saved as a PaddleFormers flex checkpoint), made
once; each tree converts it in a fresh process (``bench/convert.py``'s ``convert`` child: this tree's script,
that tree's package) under ``py-spy record --format raw --threads --nonblocking`` at ``--rate`` samples per
second, the trees interleaved, ``--reps`` times. A sample counts when its stack is inside ``convert()`` (the
preparation, then the export's producer) or its thread is one of the export's; it belongs to the deepest
stage its stack shows: the preparation's and the reads' stages below, then ``profile_export.py``'s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import profile_export as P  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "profile_convert.json"
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

STAGES = [
    ("model class import", ("model_class (",)),
    ("lazy model", ("build_lazy_model",)),
    ("index, checks, mapping", ("open_checkpoint", "check_against_model", "build_model_source", "load_model_config",
                                "detect (", "coerce_config", "split_lora", "lora_only")),
    ("preadv into the writer's buffers", ("_preadv_all", "_Tensor.pread")),
    ("map and populate (transposed reads)", ("_populate", "_Tensor._map", "_Tensor.mapped", "_Gate.")),
    *P.STAGES,
]


def in_convert(frames: list, thread: str) -> bool:
    return any(f.startswith("convert (") and "convert/convert.py" in f for f in frames) or thread.startswith(
        P.EXPORT_THREADS)


def run_one(py_spy: str, tree: Path, src: Path, rate: float, workdir: Path) -> dict:
    out, prof = workdir / "out", workdir / "prof.txt"
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [py_spy, "record", "--format", "raw", "--threads", "--nonblocking", "--rate", str(rate), "-o", str(prof),
           "--", sys.executable, str(BENCH / "convert.py"), "--variant", "convert", "--root", str(src), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not prof.exists():
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    child = json.loads(lines[-1]) if lines else {}
    res = P.parse(prof.read_text(), rate, P.line_rules(tree), STAGES, in_convert)
    res.update(seconds=round(child.get("seconds", 0.0), 4), prepare_s=round(child.get("prepare_s", 0.0), 4),
               export_s=round(child.get("timings", {}).get("total_s", 0.0), 4),
               peak_extra_rss=child.get("rss_extra", {}).get("VmRSS"))
    shutil.rmtree(out, ignore_errors=True)
    prof.unlink()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the tiny mode (bench/_common.py): this environment's py-spy, this tree against itself, once
    ap.add_argument("--py-spy", required=not C.TINY, default=P._py_spy_beside_python() if C.TINY else None,
                    help="the py-spy executable")
    ap.add_argument("--before", type=Path, required=not C.TINY, default=C.tiny(None, ROOT),
                    help="a checkout of the tree to compare with")
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--rate", type=int, default=C.tiny(500, 50))  # py-spy takes whole samples per second
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    args = ap.parse_args(argv)
    if not args.py_spy:
        ap.error(f"no py-spy beside {sys.executable} nor on PATH: give --py-spy")
    trees = {"before": args.before.resolve(), "after": ROOT}
    runs = {t: [] for t in trees}
    quiet = []
    work = Path(tempfile.mkdtemp(prefix="pfc-prof-convert-"))
    try:
        facts = C.run_child([str(BENCH / "convert.py"), "--make", str(work / "src")])
        for rep in range(args.reps):
            for t, tree in trees.items():
                quiet.append(C.wait_quiet(120))
                run_dir = Path(tempfile.mkdtemp(dir=work))
                r = run_one(args.py_spy, tree, work / "src", args.rate, run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
                runs[t].append(r)
                print(f"rep {rep + 1} {t:>6}: {r['seconds']:.3f} s (preparation {r['prepare_s']:.3f}), CPU "
                      f"{r['cpu_s_total']:.3f} s: " + ", ".join(f"{k} {s:.3f}" for k, s in r["cpu_s_by_stage"].items()),
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda t, k: round(C.median([r[k] for r in runs[t]]), 4)  # noqa: E731
    out = {"benchmark": "profile_convert", "tool": "py-spy record --format raw --threads --nonblocking",
           "rate_hz": args.rate, "repetitions": args.reps, "trees": {k: str(v) for k, v in trees.items()},
           "checkpoint": facts, "stages": [s for s, _ in STAGES],
           "trees_results": {t: {"seconds_median": med(t, "seconds"), "prepare_s_median": med(t, "prepare_s"),
                                 "export_s_median": med(t, "export_s"), "cpu_s_total_median": med(t, "cpu_s_total"),
                                 "cpu_s_by_stage_median": P._median_dicts([r["cpu_s_by_stage"] for r in runs[t]]),
                                 "cpu_s_by_thread_median": P._median_dicts([r["cpu_s_by_thread"] for r in runs[t]]),
                                 "runs": runs[t]} for t in trees},
           "quiet_checks": {"busy_runs": sum(not q["quiet"] for q in quiet),
                            "max_waited_s": max(q["waited_s"] for q in quiet)}}
    C.write_result(args.result, out)
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
