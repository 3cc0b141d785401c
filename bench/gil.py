"""Do the export's byte operations release the GIL here? Each one, one thread against two.

Run (about a minute; waits for idle CPUs)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/gil.py                      # 5 interleaved repetitions -> bench/results/gil.json

Every operation runs on private data per thread: one thread does W bytes of it, then two threads do W
each at the same time. ``scaling`` = 2 x t(one thread) / t(two threads): 2.0 when the two run side
by side on the two cores (the GIL released), 1.0 when they take turns (the GIL held), as the pure
Python control shows. ``cpu_per_wall`` of the two-thread run says the same from the CPU's side.
The operations are the export's, with the package's own functions and block sizes: numpy's copy of
contiguous bytes, the writer's transposed copy (``host.copy.copy_into``, 2 MB blocks of a Llama
``[2816, 1024]`` weight into Hugging Face's order), the float32 -> bfloat16 cast through ml_dtypes,
through numpy integer arithmetic, and through Paddle's CPU kernel, BLAKE3 of 2 MB pieces (one thread
per hasher), the LoRA product ``[1024, 16] @ [16, 2816]`` (OpenBLAS held to one thread for this
measure: ``OPENBLAS_NUM_THREADS=1``, as ``paddle.distributed.launch`` sets ``OMP_NUM_THREADS=1``)
and ``pwrite`` of 16 MB pieces into a file on /dev/shm. The one-thread rates are the per-thread
rates of the thread-scaling table in docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "gil.json"
WORK_BYTES = C.tiny(256, 16) * 2**20  # per thread and operation (tiny mode, bench/_common.py: one call each)


def _ops():
    import blake3
    import numpy as np

    from paddle_fullparam_callbacks.host import casts
    from paddle_fullparam_callbacks.host.copy import copy_into, row_blocks

    rng = np.random.default_rng(0)

    def contiguous_copy():
        src = rng.integers(0, 255, 16 * 2**20, dtype=np.uint8)
        dst = np.empty_like(src)
        return src.nbytes, lambda: np.copyto(dst, src)

    def transposed_copy():
        w = rng.standard_normal((2816, 1024)).astype(np.float32)  # Paddle's [in, out]; the file wants w.T
        src, buf = w.T, np.empty(2 * 2**20, np.uint8)
        blocks = list(row_blocks(src, buf.nbytes))

        def run():
            for r0, r1 in blocks:
                part = src[r0:r1]
                copy_into(buf[:part.nbytes].view(np.float32).reshape(part.shape), part)
        return w.nbytes, run

    def cast(kind):
        def make():
            x = rng.standard_normal(4 * 2**20).astype(np.float32)  # 16 MB of input
            out = np.empty(x.shape, np.uint16)
            if kind == "paddle":
                def run():
                    for s in range(0, x.size, 2**20):  # Paddle's kernel, 4 MB of input per call
                        t = casts.to_paddle(x[s:s + 2**20], "float32").astype("bfloat16")
                        out[s:s + 2**20] = t.view("uint16").numpy()
                return x.nbytes, run
            use_ml = kind == "ml_dtypes"
            return x.nbytes, lambda: casts.cast_into(out, x, "float32", "bfloat16") if use_ml else \
                [casts.f32_to_bf16(out[s:s + 2**18], x[s:s + 2**18], use_ml_dtypes=False) for s in range(0, x.size, 2**18)]
        return make

    def hashing():
        data = rng.integers(0, 255, 16 * 2**20, dtype=np.uint8)
        pieces = [data[i:i + 2 * 2**20] for i in range(0, data.nbytes, 2 * 2**20)]

        def run():
            h = blake3.blake3()
            for p in pieces:
                h.update(p)
            h.digest()
        return data.nbytes, run

    def matmul():
        a = rng.standard_normal((1024, 16)).astype(np.float32)
        b = rng.standard_normal((16, 2816)).astype(np.float32)
        out = np.empty((1024, 2816), np.float32)
        return out.nbytes, lambda: np.matmul(a, b, out=out)

    def pwrite():
        data = rng.integers(0, 255, 16 * 2**20, dtype=np.uint8)
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="pfc-gil-")
        os.unlink(path)  # the memory goes with the descriptor

        def run():
            os.pwrite(fd, memoryview(data), 0)
        return data.nbytes, run

    def python_loop():
        return 4 * 2**20, lambda: sum(range(200_000))  # "bytes": a nominal size, the loop holds the GIL

    return {"python_loop (control)": python_loop, "numpy_contiguous_copy": contiguous_copy,
            "transposed_copy_into": transposed_copy, "cast_bf16_ml_dtypes": cast("ml_dtypes"),
            "cast_bf16_numpy": cast("numpy"), "cast_bf16_paddle": cast("paddle"), "blake3_update_2MB": hashing,
            "matmul_lora_r16": matmul, "pwrite_tmpfs_16MB": pwrite}


def _timed(threads, fns, reps):
    def loop(fn):
        for _ in range(reps):
            fn()
    ts = [threading.Thread(target=loop, args=(fns[i],)) for i in range(threads)]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / wall


def child(reps: int) -> dict:
    import paddle  # noqa: F401  (loaded before timing)

    ops, out = _ops(), {"_others_cpu_fraction": None}
    share = C.CpuShare().__enter__()
    made = {name: [make(), make()] for name, make in ops.items()}  # private data for each of two threads
    runs = {name: {"t1": [], "t2": [], "cpu2": []} for name in ops}
    for _ in range(reps):
        for name, pair in made.items():
            nbytes, _ = pair[0]
            n = max(1, WORK_BYTES // nbytes)
            fns = [p[1] for p in pair]
            fns[0]()  # warm
            t1, _ = _timed(1, fns, n)
            t2, cpu2 = _timed(2, fns, n)
            runs[name]["t1"].append(t1)
            runs[name]["t2"].append(t2)
            runs[name]["cpu2"].append(cpu2)
    share.__exit__(None, None, None)
    out["_others_cpu_fraction"] = round(share.foreign_fraction, 3)
    for name, r in runs.items():
        nbytes = made[name][0][0]
        n = max(1, WORK_BYTES // nbytes)
        t1, t2 = C.median(r["t1"]), C.median(r["t2"])
        out[name] = {"one_thread_gb_s": round(n * nbytes / 1e9 / t1, 2), "two_threads_gb_s": round(2 * n * nbytes / 1e9 / t2, 2),
                     "scaling": round(2 * t1 / t2, 2), "cpu_per_wall_two_threads": round(C.median(r["cpu2"]), 2),
                     "all_scaling": [round(2 * a / b, 2) for a, b in zip(r["t1"], r["t2"])]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--reps", type=int, default=C.tiny(5, 1))
    ap.add_argument("--result", type=Path, default=RESULT_PATH)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.reps)), flush=True)
        return 0
    quiet = C.wait_quiet(300)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    res = C.run_child([__file__, "--child", "--reps", str(args.reps)], env=env)
    res.pop("process_seconds", None)
    others = res.pop("_others_cpu_fraction")
    for name, r in res.items():
        print(f"{name:>24}: 1 thread {r['one_thread_gb_s']:6.2f} GB/s, 2 threads {r['two_threads_gb_s']:6.2f} GB/s, "
              f"scaling {r['scaling']:.2f} (CPU/wall {r['cpu_per_wall_two_threads']:.2f})")
    C.write_result(args.result, {
        "benchmark": "gil", "repetitions": args.reps, "work_bytes_per_thread": WORK_BYTES, "operations": res,
        "rule": "scaling = 2 x t(1 thread) / t(2 threads, each the same work): 2.0 = side by side (GIL released), "
                "1.0 = in turns (GIL held); medians of interleaved repetitions",
        "quiet_check": quiet, "others_cpu_fraction": others,
    })
    print(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
