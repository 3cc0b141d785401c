"""Scoring a snapshot with lm-evaluation-harness (issue 41): the bundled evaluator against the harness's own CLI,
and the training stall with the evaluator on against off.

Run (several minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/lm_eval.py                 # -> bench/results/lm_eval.json
    $PY bench/lm_eval.py --reps 5

**Time to score one snapshot.** A snapshot of each model size (``tiny``: the tests' Llama, hidden 128, 2 layers,
1.7 MB; ``large``: the 673 MB float32 Llama of ``export_single.py``; both with the demo's tokenizer) is scored on
the bundled task pair (``pfc_choice``, 96 log-likelihoods; ``pfc_generate``, 16 greedy generations) in the ``hf``
environment, each run a fresh process as a user would wait for it, interleaved, the order swapped every
repetition:

- ``ours``: ``python -m paddle_fullparam_callbacks.consumers.evaluate.lmeval run`` (what the evaluation hook runs
  for ``evaluate.lm_eval``: ``simple_evaluate`` with only the task folder indexed, offline);
- ``cli``: ``lm-eval run --model hf --model_args pretrained=SNAPSHOT,dtype=float32 --tasks pfc_choice,pfc_generate
  --include_path FOLDER --device cpu --batch_size 1 --output_path DIR``, offline, in the task folder.

Both must give the same metrics (checked). Target: ours <= 0.6x the CLI's time (median of paired ratios). The
CPU time of each run (user + system, from the kernel) is recorded beside the wall time: on a shared machine it
moves least with others' load.

**The training stall.** ``eval_stall.py``'s children (the 673 MB model, ``--exports`` exports, ``--steps`` steps
of fixed CPU work between them, the hook drained after each step) with the lm-eval evaluator (``on``, at
``evaluate.nice=10``) and without (``off``), interleaved. Target: the stall on <= 1.05x off.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT_PATH = C.RESULTS_DIR / "lm_eval.json"
TASKS = ["pfc_choice", "pfc_generate"]
SIZES = {"tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
         "large": None}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def make_snapshot(size: str, out: Path) -> dict:
    """A child: one committed snapshot of ``size`` with the demo's tokenizer."""
    C.quiet_logs()
    from paddle_fullparam_callbacks.cli.demo import demo_tokenizer, make_tiny_llama
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    model = make_tiny_llama(seed=0, **SIZES[size]) if SIZES[size] else C.build_llama(seed=0)
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=5GB"])
    session = ExportSession(cfg, out)
    session.start()
    info = session.export(build_model_source(model, cfg, demo_tokenizer()), 1)
    session.close()
    return {"path": str(info.path), "bytes": sum(f.stat().st_size for f in Path(info.path).glob("*.safetensors"))}


def hf_python() -> str:
    return os.environ.get("PFC_HF_PYTHON") or subprocess.run(
        ["bash", str(ROOT / "scripts" / "env.sh"), "hf"], capture_output=True, text=True, check=True).stdout.strip()


def _timed(argv, cwd=None, env=None) -> tuple:
    """(wall seconds, CPU seconds: user + system of the process and what it waited for) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=3600)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def score_ours(hf: str, snapshot: str, work: Path) -> tuple:
    from paddle_fullparam_callbacks.consumers.evaluate.lmeval.spec import MODULE, build_spec
    from paddle_fullparam_callbacks.config.consumers import LmEvalConfig

    spec = json.dumps(build_spec(LmEvalConfig(tasks=TASKS), "bench"))
    output = work / "ours.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    timing = _timed([hf, "-m", MODULE, "run", snapshot, "--output", str(output), "--spec", spec], env=env)
    result = json.loads(output.read_text())
    return timing, {k: v for k, v in result.items() if k.startswith("lm_eval.")}


def score_cli(hf: str, snapshot: str, work: Path) -> tuple:
    from paddle_fullparam_callbacks.consumers.evaluate.lmeval.spec import bundled_tasks, metric_scores

    out = work / "cli"
    shutil.rmtree(out, ignore_errors=True)
    cli = str(Path(hf).parent / "lm-eval")
    argv = [cli, "run", "--model", "hf", "--model_args", f"pretrained={snapshot},dtype=float32", "--tasks",
            ",".join(TASKS), "--include_path", str(bundled_tasks()), "--device", "cpu", "--batch_size", "1",
            "--output_path", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    timing = _timed(argv, cwd=str(bundled_tasks()), env={**env, **OFFLINE})
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return timing, metric_scores(results)


def scoring(hf: str, sizes, reps: int, tmp: Path) -> dict:
    out = {}
    for size in sizes:
        snap = C.run_child([__file__, "--make-snapshot", size, "--out", str(tmp / size)], timeout=1800)
        runs, cpu = {"ours": [], "cli": []}, {"ours": [], "cli": []}
        equal, quiet = True, []
        for rep in range(reps):
            order = ("ours", "cli") if rep % 2 == 0 else ("cli", "ours")
            scores = {}
            for variant in order:
                quiet.append(C.wait_quiet(max_wait=30))
                fn = score_ours if variant == "ours" else score_cli
                (seconds, cpu_s), scores[variant] = fn(hf, snap["path"], tmp)
                runs[variant].append(round(seconds, 3))
                cpu[variant].append(round(cpu_s, 3))
            equal = equal and scores["ours"] == scores["cli"]
            print(f"{size} rep {rep}: ours {runs['ours'][-1]:.1f} s ({cpu['ours'][-1]:.1f} CPU-s), cli "
                  f"{runs['cli'][-1]:.1f} s ({cpu['cli'][-1]:.1f} CPU-s), load {os.getloadavg()[0]:.1f}, same metrics: "
                  f"{scores['ours'] == scores['cli']}", flush=True)
        out[size] = {"snapshot_bytes": snap["bytes"], "seconds": runs, "cpu_seconds": cpu,
                     "seconds_median": {k: round(C.median(v), 3) for k, v in runs.items()},
                     "cpu_seconds_median": {k: round(C.median(v), 3) for k, v in cpu.items()},
                     "ratio_ours_vs_cli_median": round(C.median([o / c for o, c in zip(runs["ours"], runs["cli"])]), 4),
                     "cpu_ratio_ours_vs_cli_median": round(C.median([o / c for o, c in zip(cpu["ours"], cpu["cli"])]), 4),
                     "same_metrics": equal, "metrics": scores["ours"], "quiet_before_runs": quiet}
    return out


def stall(hf: str, reps: int, exports: int, steps: int, tmp: Path) -> dict:
    script = str(Path(__file__).resolve().parent / "eval_stall.py")
    runs = {"off": [], "on": []}
    for rep in range(reps):
        for v in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            C.wait_quiet(max_wait=30)
            work = tmp / f"stall-{v}-{rep}"
            work.mkdir()
            try:
                # the tiny run (the suite's) keeps the evaluator at the training's priority: beside a loaded
                # machine's other work a nice-10 process that imports torch may wait minutes for a core
                child = "on_nice0" if v == "on" and C.TINY else v
                r = C.run_child([script, "--variant", child, "--out", str(work / "out"), "--exports", str(exports),
                                 "--steps", str(steps), "--eval-python", hf], timeout=3600)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            runs[v].append(r)
            print(f"stall rep {rep} {v}: stalls {[round(x, 3) for x in r['stalls']]} s, training "
                  f"{[round(x, 2) for x in r['train_seconds']]} s, others' CPU {r['cpu_share']['foreign_fraction']:.2f}, "
                  f"evaluations {r['evaluations']}", flush=True)
    stall_s = {v: C.median([s for r in runs[v] for s in r["stalls"]]) for v in runs}
    train_s = {v: C.median([s for r in runs[v] for s in r["train_seconds"]]) for v in runs}
    return {"exports_per_run": exports, "steps_between_exports": steps, "stall_seconds_median": stall_s,
            "stall_ratio_on_vs_off": round(stall_s["on"] / stall_s["off"], 4),
            "training_slowdown_on_vs_off": round(train_s["on"] / train_s["off"], 4), "train_seconds_median": train_s,
            "evaluations_ok": all(s == "ok" for r in runs["on"] for s in r["evaluations"]),
            "evaluations": sum(len(r["evaluations"]) for r in runs["on"]), "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-snapshot", choices=sorted(SIZES))
    ap.add_argument("--out")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=C.tiny(["tiny", "large"], ["tiny"]))
    ap.add_argument("--reps", type=int, default=C.tiny(5, 1))
    ap.add_argument("--stall-reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--steps", type=int, default=C.tiny(150, 2), help="training steps between exports")
    ns = ap.parse_args()
    if ns.make_snapshot:
        print(json.dumps(make_snapshot(ns.make_snapshot, Path(ns.out))))
        return
    hf = hf_python()
    tmp = Path(tempfile.mkdtemp(prefix="pfc_bench_lmeval_"))
    try:
        t0 = time.time()
        load_before = os.getloadavg()
        scores = scoring(hf, ns.sizes, ns.reps, tmp)
        stalls = stall(hf, ns.stall_reps, ns.exports, ns.steps, tmp)
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = {size: s["ratio_ours_vs_cli_median"] for size, s in scores.items()}
    result = {
        "benchmark": "lm_eval", "tasks": TASKS, "repetitions": ns.reps, "scoring": scores, "stall": stalls,
        "targets": {"scoring.<size>.ratio_ours_vs_cli_median": "<= 0.6", "stall.stall_ratio_on_vs_off": "<= 1.05"},
        "met": {**{f"scoring.{size}": r <= 0.6 for size, r in ratio.items()},
                "stall": stalls["stall_ratio_on_vs_off"] <= 1.05, "same_metrics": all(s["same_metrics"] for s in scores.values())},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "seconds": round(time.time() - t0, 1),
        "notes": ["each scoring run is a fresh process in the hf environment (import, index, load, score, write)",
                  "cli indexes the harness's ~14,000 bundled task files before it reads --include_path's",
                  "stall = export() + every drain() until the next export, on the training thread (eval_stall.py)"],
    }
    C.write_result(RESULT_PATH, result)
    for size, s in scores.items():
        print(f"{size}: ours {s['seconds_median']['ours']:.1f} s, cli {s['seconds_median']['cli']:.1f} s, "
              f"ratio {s['ratio_ours_vs_cli_median']:.2f} (CPU time {s['cpu_ratio_ours_vs_cli_median']:.2f}; same "
              f"metrics: {s['same_metrics']})")
    print(f"stall per export: off {stalls['stall_seconds_median']['off']:.3f} s, on {stalls['stall_seconds_median']['on']:.3f} s "
          f"(x{stalls['stall_ratio_on_vs_off']:.3f}); training x{stalls['training_slowdown_on_vs_off']:.3f}; "
          f"evaluations ok: {stalls['evaluations_ok']}")


if __name__ == "__main__":
    main()
