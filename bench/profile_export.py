"""Where an export's CPU time goes, stage by stage, sampled by py-spy: this tree against another one.

Run (py-spy in a venv of its own, outside the clone; a few minutes)::

    python3 -m venv /tmp/pyspy && /tmp/pyspy/bin/pip install py-spy
    git archive <commit> | tar -x -C /tmp/before             # the tree to compare with
    PY=$(scripts/env.sh paddleformers)
    $PY bench/profile_export.py --py-spy /tmp/pyspy/bin/py-spy --before /tmp/before
        # -> bench/results/profile_export.json

Each variant (``export_single.py``'s children: ``ours``, ``ours_bf16`` on /dev/shm, and ``lora_merge.py``'s
``merged``) runs in a fresh process under ``py-spy record --format raw --threads --nonblocking`` at
``--rate`` samples per second, once per tree, interleaved, ``--reps`` times. Only running threads are
sampled (py-spy's default), so a stage's samples / rate are CPU seconds, summed over the threads that
did it. A sample belongs to the deepest stage its stack shows (the table ``STAGES``); samples outside
the export (building the model, imports) are left out: a thread's sample counts when its stack is inside
``ExportSession.export`` or it is one of the writer's or the pool's threads.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "profile_export.json"
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

# (stage, substrings of a frame): the first stage whose substring is in a sample's deepest matching frame
STAGES = [
    # the product's rule (issue 30) and its faster computation (issue 42): the float64 GEMM lines are the
    # "np.matmul(" statements below; the roundings, the bound's checks and the exact sums are the rest
    ("lora product: rounding and checks", ("_rows_into", "_step_into", "_settle", "exact_sum_float32",
                                           "_round_scaled", "round_to_float32", "_lowest_bit_exponents",
                                           "exact_product")),
    ("lora product (matmul)", ("_Product.get", "MergedArray.__init__", "delta_hf", "merged_block")),
    ("lora merge (scale, add)", ("MergedArray.fill", "merge_transform")),
    ("cast to export.dtype", ("f32_to_bf16", "cast_into", "_cast_flat", "cast_array", "astype")),
    ("transposed copies", ("copy_into",)),
    ("BLAKE3", ("Pipeline._hash", "checksum")),
    ("pwrite", ("pwrite_all", "_pwrite_all")),
    ("fsync and writeback", ("start_writeback", "fsync", "FileState.end", "_FileState.end")),
    ("commit (index, manifest, rename)", ("finish_global", "Committer", "finish_local")),
    ("planning and mapping", ("plan_export", "prepare (session")),
    ("assembly (producer)", ("stream_tensors", "LocalAssembler", "host_array", "assemble_destination")),
    ("writer bookkeeping", ("SnapshotWriter", "_queue_pieces", "Pipeline.", "WorkerPool", "BlockPool")),
]
EXPORT_THREADS = ("pfc-work", "pfc-write", "pfc-writer", "pfc-file", "pfc-prepare", "pfc-commit")
# statements that call C code (no Python frame of their own): their lines name the stage
STATEMENTS = [("BLAKE3", ".hash.update("), ("pwrite", "self._pwrite("), ("transposed copies", "copy_into("),
              ("lora product (matmul)", "np.matmul("), ("lora merge (scale, add)", "out *= np.float32("),
              ("lora merge (scale, add)", "out += as_float32("), ("lora merge (scale, add)", "tmp *= np.float32("),
              ("lora merge (scale, add)", "tmp += as_float32(")]  # (W's transpose added by copy_into: "transposed copies")


def line_rules(tree: Path) -> list:
    """(stage, 'file.py:line') for each line of the tree's writer and LoRA merge that is one of STATEMENTS."""
    rules = []
    pkg = tree / "paddle_fullparam_callbacks"
    for path in sorted([*(pkg / "export" / "write").glob("*.py"), pkg / "models" / "lora" / "merge.py",
                        pkg / "models" / "lora" / "product.py"]):
        for i, text in enumerate(path.read_text().splitlines(), 1):
            for stage, stmt in STATEMENTS:
                if stmt in text and not text.lstrip().startswith(("#", "def ", "from ", "import ")):
                    rules.append((stage, (f"{path.name}:{i})",)))
    return rules


WAITS = ("Condition.wait", "Condition.notify", "Event.wait", "Event.set",
         "Thread.join", "_loop (", ".get (", "acquire")


def stage_of(frames: list, rules=(), stages=STAGES) -> str:
    if frames and any(w in frames[-1] for w in WAITS):
        return "waits (a thread runnable in a lock, queue or the GIL)"
    for frame in reversed(frames):
        for stage, keys in (*rules, *stages):
            if any(k in frame for k in keys):
                return stage
    return "other (in the export)"


def in_export(frames: list, thread: str) -> bool:
    return any("ExportSession.export" in f for f in frames) or thread.startswith(EXPORT_THREADS)


def parse(raw: str, rate: float, rules=(), stages=STAGES, inside=in_export) -> dict:
    """CPU seconds per stage, and per thread kind, from py-spy's raw (collapsed) output: the samples
    ``inside(frames, thread)`` keeps."""
    by_stage, threads = collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        if not inside(frames, thread):
            continue
        by_stage[stage_of(frames[1:], rules, stages)] += int(count)
        threads[thread.rstrip("0123456789-") or thread] += int(count)
    return {"cpu_s_by_stage": {k: round(v / rate, 3) for k, v in by_stage.most_common()},
            "cpu_s_by_thread": {k: round(v / rate, 3) for k, v in threads.most_common()},
            "cpu_s_total": round(sum(by_stage.values()) / rate, 3)}


def run_one(py_spy: str, tree: Path, variant: str, rate: float, workdir: Path) -> dict:
    out = workdir / "out"
    prof = workdir / "prof.txt"
    script, args = ((BENCH / "lora_merge.py", ["--variant", "merged"]) if variant == "lora_merged"
                    else (BENCH / "export_single.py", ["--variant", variant]))
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [py_spy, "record", "--format", "raw", "--threads", "--nonblocking", "--rate", str(rate), "-o", str(prof),
           "--", sys.executable, str(script), *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not prof.exists():
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    import json

    child = json.loads(lines[-1]) if lines else {}
    res = parse(prof.read_text(), rate, line_rules(tree))
    res["export_seconds"] = round(child.get("seconds", 0.0), 4)
    shutil.rmtree(out, ignore_errors=True)
    prof.unlink()
    return res


def _median_dicts(ds: list) -> dict:
    keys = sorted({k for d in ds for k in d})
    return {k: round(C.median([d.get(k, 0.0) for d in ds]), 3) for k in keys}


def _py_spy_beside_python():
    """The tiny mode's py-spy: the one installed beside this interpreter (the paddleformers environment pins
    it), else the one on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.is_file() else shutil.which("py-spy")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the tiny mode (bench/_common.py): this environment's py-spy, this tree against itself, one variant of each script
    ap.add_argument("--py-spy", required=not C.TINY, default=_py_spy_beside_python() if C.TINY else None,
                    help="the py-spy executable (installed outside the clone)")
    ap.add_argument("--before", type=Path, required=not C.TINY, default=C.tiny(None, ROOT),
                    help="a checkout of the tree to compare with")
    ap.add_argument("--variants", default=C.tiny("ours,ours_bf16,lora_merged", "ours,lora_merged"))
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    # py-spy takes a whole number of samples per second ("50.0" is refused); tiny: fewer, it slows the child less
    ap.add_argument("--rate", type=int, default=C.tiny(500, 50))
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    args = ap.parse_args(argv)
    if not args.py_spy:
        ap.error(f"no py-spy beside {sys.executable} nor on PATH: give --py-spy")
    trees = {"before": args.before.resolve(), "after": ROOT}
    variants = [v for v in args.variants.split(",") if v]
    runs = {(t, v): [] for t in trees for v in variants}
    quiet = []
    for rep in range(args.reps):
        for v in variants:
            for t, tree in trees.items():
                work = Path(tempfile.mkdtemp(prefix="pfc-prof-", dir="/dev/shm"))
                try:
                    quiet.append(C.wait_quiet(120))
                    r = run_one(args.py_spy, tree, v, args.rate, work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                runs[(t, v)].append(r)
                print(f"rep {rep + 1} {v:>12} {t:>6}: export {r['export_seconds']:.3f} s, CPU in the export "
                      f"{r['cpu_s_total']:.3f} s: " + ", ".join(f"{k} {s:.3f}" for k, s in r["cpu_s_by_stage"].items()),
                      flush=True)
    out = {"benchmark": "profile_export", "tool": "py-spy record --format raw --threads --nonblocking",
           "rate_hz": args.rate, "repetitions": args.reps, "trees": {k: str(v) for k, v in trees.items()},
           "rule": " ".join(next(t for t in __doc__.split("\n\n") if t.startswith("Each variant")).split()),
           "stages": [s for s, _ in STAGES], "variants": {}}
    for v in variants:
        out["variants"][v] = {t: {"export_seconds_median": round(C.median([r["export_seconds"] for r in runs[(t, v)]]), 4),
                                  "cpu_s_total_median": round(C.median([r["cpu_s_total"] for r in runs[(t, v)]]), 3),
                                  "cpu_s_by_stage_median": _median_dicts([r["cpu_s_by_stage"] for r in runs[(t, v)]]),
                                  "cpu_s_by_thread_median": _median_dicts([r["cpu_s_by_thread"] for r in runs[(t, v)]]),
                                  "runs": runs[(t, v)]} for t in trees}
    out["quiet_checks"] = {"busy_runs": sum(not q["quiet"] for q in quiet), "max_waited_s": max(q["waited_s"] for q in quiet)}
    C.write_result(args.result, out)
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
