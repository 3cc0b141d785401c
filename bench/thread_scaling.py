"""The thread-scaling table of ``export.threads``: the points measured by ``export_single.py`` (1 and 2
threads, tmpfs, float32 kept and float32 -> bfloat16) and a prediction for 8, 16 and 24 cores per rank.

Run after ``export_single.py`` (no model is built; it reads ``bench/results/export_single.json``)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/thread_scaling.py        # -> bench/results/thread_scaling.json

The model of the prediction (a prediction, not a measurement): the one-thread run's writer statistics
give the CPU seconds of each stage of the byte work for this model (transposed copies, casts and
LoRA merges computed into buffers: ``copy_s + fill_s``; BLAKE3: ``hash_s``; ``pwrite`` into the page
cache: ``write_s``), at this machine's per-core rates. With ``n`` threads the parallel stage is spread
over them, while hashing and writing each take one piece at a time in file order (side by side): so

    T(n) = fixed + max(work / n, hash_s, write_s)        (work = copy + fill + hash + write)

with ``fixed`` the planning and commit seconds (``plan_s + commit_s``). It leaves out what more cores
bring with them on a real node (memory bandwidth shared by the node's ranks, the disk's own speed):
the bound it finds, one in-order stream of ``pwrite``, is the page cache's copy speed of one core; a
disk slower than that sets the pace instead.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SOURCE = C.RESULTS_DIR / "export_single.json"
RESULT_PATH = C.RESULTS_DIR / "thread_scaling.json"
PREDICTED_CORES = (8, 16, 24)
VARIANTS = {"float32": ("ours_t1", "ours"), "bfloat16": ("ours_bf16_t1", "ours_bf16")}


def stage_seconds(breakdown: dict) -> dict:
    w, s = breakdown["writer"], breakdown["session_s"]
    return {"copy_and_fill_s": round(w.get("copy_s", 0.0) + w.get("fill_s", 0.0), 4), "hash_s": round(w["hash_s"], 4),
            "write_s": round(w["write_s"], 4), "fixed_s": round(s["plan_s"] + s["commit_s"], 4)}


def per_thread_rates(w: dict, stages: dict) -> dict:
    """GB/s of one thread in each stage: copies and lazy fills per byte they produced, hash and pwrite per byte."""
    made = w.get("bytes_copied", 0.0) + w.get("bytes_filled", 0.0)
    return {"copy_and_fill": round(made / 1e9 / stages["copy_and_fill_s"], 2) if stages["copy_and_fill_s"] else None,
            "hash": round(w["bytes_hashed"] / 1e9 / stages["hash_s"], 2),
            "write": round(w["bytes_written"] / 1e9 / stages["write_s"], 2)}


def predict(stages: dict, n: int) -> float:
    work = stages["copy_and_fill_s"] + stages["hash_s"] + stages["write_s"]
    return stages["fixed_s"] + max(work / n, stages["hash_s"], stages["write_s"])


def main() -> None:
    need = lambda *keys: C.read_input(SOURCE.name, *keys, made_by="bench/export_single.py")  # noqa: E731
    src = need()
    tmpfs = need("regimes", "tmpfs")
    for one, two in VARIANTS.values():  # every figure the model reads, checked before any is used
        need("regimes", "tmpfs", f"breakdown_{one}", "writer", "bytes_written")
        need("regimes", "tmpfs", "seconds", one), need("regimes", "tmpfs", "seconds", two)
    rows = {}
    for dtype, (one, two) in VARIANTS.items():
        breakdown = tmpfs[f"breakdown_{one}"]
        stages = stage_seconds(breakdown)
        written = breakdown["writer"]["bytes_written"] / 1e9  # the snapshot's bytes (half the model's in bf16)
        measured = {1: tmpfs["seconds"][one], 2: tmpfs["seconds"][two]}
        predicted = {n: predict(stages, n) for n in PREDICTED_CORES}
        rows[dtype] = {
            "stages_one_thread_s": stages,
            "per_thread_gb_s": per_thread_rates(breakdown["writer"], stages),
            "measured_s": {str(n): round(t, 4) for n, t in measured.items()},
            "measured_gb_s": {str(n): round(written / t, 2) for n, t in measured.items()},
            "model_s": {str(n): round(predict(stages, n), 4) for n in (1, 2)},
            "predicted_s": {str(n): round(t, 4) for n, t in predicted.items()},
            "predicted_gb_s": {str(n): round(written / t, 2) for n, t in predicted.items()},
            "bound_beyond_2_threads": max(("hash_s", "write_s"), key=lambda k: stages[k]),
        }
    result = {"benchmark": "thread_scaling", "source": str(SOURCE.relative_to(C.RESULTS_DIR.parent.parent)),
              "source_commit": src.get("package_commit"), "regime": "tmpfs", "model_bytes": src["model_bytes"],
              "rule": "T(n) = plan_s + commit_s + max((copy + fill + hash + write) / n, hash, write), from the "
                      "one-thread run's writer statistics; 8, 16 and 24 are a prediction",
              "variants": rows, "machine": C.machine_info(), "package_commit": C.git_commit(), "date": C.now_iso()}
    C.write_result(RESULT_PATH, result)
    for dtype, r in rows.items():
        print(f"{dtype}: measured {r['measured_s']} s; model {r['model_s']}; predicted {r['predicted_s']} "
              f"(bound: {r['bound_beyond_2_threads']})")


if __name__ == "__main__":
    main()
