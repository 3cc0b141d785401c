"""A 7B model on this machine (issue 47): live export, FP8, async, two ranks and convert at Qwen2.5-7B's dimensions,
against ``cp -r``, a raw write, PaddleFormers' ``save_pretrained`` and a raw copy, in one run, on one disk.

The full run (in a quiet window: nothing else on the machine, no vLLM servers; about 35-45 minutes)::

    cd <clone> && PYTHONPATH=$PWD PFC_HF_PYTHON=$(scripts/env.sh hf) $(scripts/env.sh paddleformers) bench/real_size.py
    # -> bench/results/real_size.json (it replaces the mid-size run's); the log on stdout

It needs 19.4 GB of MemAvailable and 32.5 GB free in ``--work-dir`` (/tmp: the machine's disk), checked before
anything is written (one line naming what is short); the model is 15.23 GB, the rest is two processes beside it
and the export's extra; the disk holds two snapshots' worth at a time. Smaller runs, same code (``--scale mid``:
4 layers, vocab 32000, 2.32 GB; ``--scale vocab``: 2 layers at the real vocabulary, 3.11 GB; ``--layers`` and
``--vocab`` override either)::

    ... bench/real_size.py --scale mid --result bench/results/real_size.json

The model: PaddleFormers ``LlamaForCausalLM`` (its Qwen2 class needs paddlefleet, which does not install here) with
vocab 152064, 28 layers, hidden 3584, intermediate 18944, 28 heads, 4 KV heads, an untied head: 7.615 B
parameters, 15.23 GB in bfloat16, 255 tensors, random weights built on the CPU (``paddle.seed(0)``), no optimizer.
The callback is driven as a Trainer drives it (``on_train_begin``, then ``on_step_end`` and ``on_save``; the
defaults: 5GB shards).

Phases, each in its own process(es), in this order (``bench/_real_size_single.py`` and ``_real_size_ranks.py``
say how each is measured):

1. one process: the 0.67 GB model of ``export_single.py`` exported the same way (seconds per byte); the large
   model; ``--reps`` rounds of the live export, ``cp -r`` of its snapshot + fsync, the FP8 export, a raw
   write of the parameters (allocated, written, fsynced: the disk's rate); the async cases (``default``; a
   fraction: a ring of that share of the snapshot, as on a host the model fills); the PaddleFormers flex
   checkpoint of the model (one ``save_state_dict`` call, or part by part where its 2x does not fit);
2. ``convert`` of that checkpoint against a raw copy of its bytes (``bench/convert.py``'s children, interleaved);
3. ``save_pretrained`` against the live export, at the largest size of the same widths whose save fits in memory
   (it holds 2x the model beside it: at 15 GB it does not fit in 24 GB; the JSON says so and at what size);
4. two ranks (mp2 over gloo, PaddleFormers' own tensor-parallel layers, each rank half): bytes each rank
   received, as the kernel counts them, against the plan's prediction; time against one process.

Checks (a failed one ends the run with exit 1, naming it, after the JSON is written): ``verify`` of every
snapshot; every tensor read back and compared with the model's (the first of each kind; a later one's files must
have the first one's BLAKE3); transformers on the meta device (``tests/hf_client/check_real_size.py``, the hf
environment) finds no missing, unexpected or mismatched key in the bf16, FP8, two-rank and converted snapshots;
every FP8 weight equals transformers' ``Fp8Quantize`` of the bf16 weight; no OOM kill (``/proc/vmstat``), no swap.

What to look at in the JSON: ``checks`` (all true) and ``met`` (the targets); ``table`` (the five measures: each
ratio paired by round, with the runs it comes from); ``table.async`` (the ring the defaults chose, MemAvailable
before and after it and at each export, the floor of each export); ``table.live.save_pretrained`` (the size it
ran at); ``conditions`` (load average, MemAvailable, disk free, OOM kills before and after); ``phase_seconds``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402
import _real_size as R  # noqa: E402
import _real_size_summary as S  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "real_size.json"


def _child(argv, timeout, env=None) -> dict:
    return C.run_child([str(BENCH / "_real_size_single.py"), *argv], timeout=timeout, env=env)


def _hf(hf_python: str, snapshot: Path) -> dict:
    from _real_size_checks import hf_check

    return hf_check(hf_python, snapshot)


def hf_python() -> str:
    """The hf environment's python (transformers, torch): ``PFC_HF_PYTHON``, else ``scripts/env.sh hf``."""
    import subprocess

    return os.environ.get("PFC_HF_PYTHON") or subprocess.run(
        ["bash", str(REPO / "scripts" / "env.sh"), "hf"], capture_output=True, text=True, check=True).stdout.strip()


def _run_label(scale: str, d: dict) -> str:
    if scale == "full":
        return "the 7.6 B run (Qwen2.5-7B's dimensions)"
    return (f"a {scale}-size run ({d['num_hidden_layers']} layers, vocab {d['vocab_size']}, Qwen2.5-7B's widths): "
            "NOT the 7.6 B run, which is pending (bench/real_size.py without --scale)")


def _stop(what: str) -> None:
    raise SystemExit(f"real_size: {what}")


def preflight(d: dict, work_dir: str) -> dict:
    """What this run and the full one need, against what is free; stops with one line if something is short."""
    need, full = R.needs(d), R.needs(R.dims("full"))
    state = R.machine_state(work_dir)
    print(f"this run: a {need['model_bytes'] / 1e9:.2f} GB model; needs {need['memory_bytes'] / 1e9:.1f} GB of "
          f"MemAvailable and {need['disk_bytes'] / 1e9:.1f} GB free in {work_dir} (the full 7.6 B run: "
          f"{full['memory_bytes'] / 1e9:.1f} GB and {full['disk_bytes'] / 1e9:.1f} GB); free now: "
          f"{state['mem_available_bytes'] / 1e9:.1f} GB, {state['disk_free_bytes'] / 1e9:.1f} GB", flush=True)
    short = R.missing(need, state)
    if short:
        _stop(f"not enough free {short}")
    if state["swap_total_bytes"]:
        print(f"note: the machine has {state['swap_total_bytes'] / 1e9:.1f} GB of swap; the run records swap use")
    return {"need": need, "full_run_need": full, "before": state}


def convert_phase(ckpt_root: Path, work: Path, reps: int, expected: dict, hf: str) -> dict:
    """convert (a fresh process each, no model description kept: a user's one-off conversion) against a raw copy
    of the checkpoint's bytes, interleaved; the first conversion checked tensor by tensor and by transformers."""
    conv = str(BENCH / "convert.py")
    runs, checks = {"convert": [], "raw_copy": []}, {}
    for rep in range(reps):
        for v in (("convert", "raw_copy") if rep % 2 == 0 else ("raw_copy", "convert")):
            out = work / f"conv-{v}-{rep}"
            os.sync()
            env = dict(os.environ, PADDLE_FULLPARAM_CACHE_DIR=str(work / f"descriptions-{rep}"))
            r = C.run_child([conv, "--variant", v, "--root", str(ckpt_root), "--out", str(out)], timeout=7200, env=env)
            r["loadavg"] = os.getloadavg()
            runs[v].append({k: r.get(k) for k in ("seconds", "rss_extra", "cpu", "prepare_s", "timings", "loadavg")})
            if v == "convert" and rep == 0:
                from _real_size_checks import check_first

                snap = Path(r["snapshot"])
                checks = check_first(snap, expected)
                checks["hf_meta"] = _hf(hf, snap)
                checks["ok"] = checks["ok"] and checks["hf_meta"]["ok"]
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(work / f"descriptions-{rep}", ignore_errors=True)
            print(f"convert rep {rep + 1}/{reps} {v:>8}: {r['seconds']:.2f} s, extra VmRSS "
                  f"{r['rss_extra']['VmRSS'] / 1e6:.0f} MB", flush=True)
    files = C.tree_bytes(ckpt_root / "checkpoint-1" / "model_state")
    return {"runs": runs, "checks": checks, "checkpoint_files": files,
            "checkpoint_bytes": sum(v for k, v in files.items() if k.endswith(".distcp"))}


def ranks_phase(d: dict, work: Path, reps: int, shard: str, hf: str) -> dict:
    sys.path.insert(0, str(REPO / "tests" / "multirank"))
    import harness

    from _real_size_checks import verify

    out = work / "mp2"
    res = harness.run_launch(BENCH / "_real_size_ranks.py", ["--dims", json.dumps(d), "--out", out, "--reps", reps,
                                                             "--max-shard-size", shard],
                             nproc=2, log_dir=str(work / "mp2-logs"), timeout=7200)
    tagged = dict(res.tagged("RSRANKS"))
    if res.rc != 0 or res.timed_out or len(tagged) != 2:
        _stop("the two-rank launch failed:\n" + res.describe())
    first = Path(tagged[0]["reps"][0]["snapshot"])
    checks = verify(first)
    checks["hf_meta"] = _hf(hf, first)
    checks["own_halves_ok"] = all(r["check"]["ok"] for t in tagged.values() for r in t["reps"])
    checks["ok"] = checks["verify_ok"] and checks["hf_meta"]["ok"] and checks["own_halves_ok"]
    shutil.rmtree(out, ignore_errors=True)
    return {"ranks": tagged, "checks": checks, "launch_seconds": round(res.seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", choices=("full", "mid", "vocab"), default="full")
    ap.add_argument("--layers", type=int, help="num_hidden_layers instead of the scale's")
    ap.add_argument("--vocab", type=int, help="vocab_size instead of the scale's")
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1), help="rounds of the single-process variants")
    ap.add_argument("--ref-reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--async-cases", help="comma-separated: default, or a fraction of the snapshot for the ring "
                                          "(default: 'default' at full size, else 'default,0.25')")
    ap.add_argument("--async-reps", type=int, default=C.tiny(2, 2))
    ap.add_argument("--train-seconds", type=float, default=0.0, help="training between async exports (0: 1.5x sync)")
    ap.add_argument("--convert-reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--pf-reps", type=int, default=C.tiny(2, 1))
    ap.add_argument("--mp2-reps", type=int, default=C.tiny(2, 1))
    ap.add_argument("--checkpoint-parts", type=int, default=0, help="0: one save_state_dict call if its 2x fits beside the model then, else parts that fit")
    ap.add_argument("--max-shard-size", default=C.tiny("5GB", "256KB"))
    ap.add_argument("--pf-layers", type=int, help="at most this many layers for save_pretrained (default: what fits)")
    ap.add_argument("--parts", default="single,convert,pf,mp2", help="comma-separated subset (for development)")
    ap.add_argument("--work-dir", default="/tmp", help="where everything is written (the machine's disk)")
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    ns = ap.parse_args(argv)
    scale = "tiny" if C.TINY else ns.scale
    d = R.dims(scale, ns.layers, ns.vocab)
    parts = set(ns.parts.split(","))
    hf = hf_python()
    pre = preflight(d, ns.work_dir)
    cases = ns.async_cases or ("default" if scale == "full" else "default,0.25")
    work = Path(tempfile.mkdtemp(prefix="pfc-real-size-", dir=ns.work_dir))
    result = {"benchmark": "real_size", "scale": scale, "dims": d, "model_bytes": R.model_bytes(d),
              "full_run": scale == "full", "run": _run_label(scale, d), "preflight": pre, "conditions": {"before": pre["before"]}, "phases": {}}
    t_start = time.perf_counter()
    try:
        if "single" in parts or "convert" in parts:
            argv = ["--dims", json.dumps(d), "--work", str(work), "--reps", str(ns.reps), "--ref-reps", str(ns.ref_reps),
                    "--async-cases", cases, "--async-reps", str(ns.async_reps), "--train-seconds", str(ns.train_seconds),
                    "--checkpoint-parts", str(C.tiny(ns.checkpoint_parts, 2)), "--hf-python", hf, "--max-shard-size", ns.max_shard_size]
            print(f"phase 1: one process ({scale}, {R.model_bytes(d) / 1e9:.2f} GB) ...", flush=True)
            t0 = time.perf_counter()
            result["phases"]["single"] = _child(argv, timeout=4 * 3600)
            result["phase_seconds"] = {"single": round(time.perf_counter() - t0, 1)}
            result["conditions"]["after_single"] = R.machine_state(ns.work_dir)
        if "convert" in parts:
            print("phase 2: convert against a raw copy ...", flush=True)
            expected = {k: (v[0], tuple(v[1]), v[2]) for k, v in result["phases"]["single"]["expected"].items()}
            t0 = time.perf_counter()
            result["phases"]["convert"] = convert_phase(work / "ckpt", work, ns.convert_reps, expected, hf)
            result.setdefault("phase_seconds", {})["convert"] = round(time.perf_counter() - t0, 1)
        shutil.rmtree(work / "ckpt", ignore_errors=True)
        if "pf" in parts:
            avail = R.meminfo()["MemAvailable"]
            layers = min(R.pf_layers_that_fit(d, avail), ns.pf_layers if ns.pf_layers is not None else 10**6)
            pf_d = dict(d, num_hidden_layers=layers)
            print(f"phase 3: save_pretrained at {layers} of {d['num_hidden_layers']} layers "
                  f"({R.model_bytes(pf_d) / 1e9:.2f} GB) ...", flush=True)
            result["phases"]["pf"] = {"mem_available_bytes": avail, "fits_at_full_size": layers == d["num_hidden_layers"],
                                      "needs_at_this_size_bytes": int((1 + R.PF_SAVE_FACTOR) * R.model_bytes(d)
                                                                      + R.PROCESS_OVERHEAD)}
            t0 = time.perf_counter()
            if layers:
                result["phases"]["pf"].update(_child(["--part", "pf", "--dims", json.dumps(pf_d), "--work", str(work),
                                                      "--reps", str(ns.pf_reps), "--max-shard-size", ns.max_shard_size],
                                                     timeout=4 * 3600))
            result.setdefault("phase_seconds", {})["pf"] = round(time.perf_counter() - t0, 1)
        if "mp2" in parts:
            short = R.missing(R.needs(d), R.machine_state(ns.work_dir))
            if short:
                _stop(f"before the two-rank phase, not enough free {short}")
            print("phase 4: two ranks (mp2) ...", flush=True)
            t0 = time.perf_counter()
            result["phases"]["mp2"] = ranks_phase(d, work, ns.mp2_reps, ns.max_shard_size, hf)
            result.setdefault("phase_seconds", {})["mp2"] = round(time.perf_counter() - t0, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["conditions"]["after"] = R.machine_state(ns.work_dir)
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    S.summarize(result)
    C.write_result(ns.result, result)
    S.print_table(result)
    print(f"wrote {ns.result}")
    failed = [k for k, ok in result["checks"].items() if not ok]
    if failed:
        _stop(f"checks failed: {failed} (figures in {ns.result})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
