"""How bench/results/fp8_order.json was measured (kept beside it; not a benchmark of `make bench`).

Paired A/B of where an FP8 file stores its scales (issue 47's 7.6 B run found every FP8 file read back for its
checksum): two checkouts, ``--before`` (scales first) and ``--after`` (scales after the weights), each child
process building PaddleFormers' Llama at Qwen2.5-7B's widths (``bench/_real_size.py`` dims, ``--scale``) and timing
``--exports`` FP8 exports through the callback, driven as a Trainer drives it (``bench/_real_size_single.Driver``),
to ``--dir``; children alternate, the order reversed every other round. From the repository's root:

    PY=$(scripts/env.sh paddleformers); $PY bench/results/fp8_order_ab.py --before B --after A --scale mid --rounds 3
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


def child(ns) -> None:
    sys.path.insert(0, str(BENCH))
    import _common as C
    import _real_size as R
    import _real_size_single as S

    C.quiet_logs()
    d = R.dims(ns.scale)
    model = S.build(d)
    stats = C.record_writer_stats()
    out = Path(ns.dir) / "out"
    driver = S.Driver(out, ["export.quantization=fp8", "retention.keep_last=1"])
    driver.begin(model)
    runs = []
    for step in range(1, ns.exports + 1):
        C.wait_quiet(60)
        with C.CpuShare() as cpu:
            t0 = time.perf_counter()
            driver.save(step, model)
            seconds = time.perf_counter() - t0
        w = stats[-1] if stats else {}
        runs.append({"seconds": round(seconds, 3), "cpu": cpu.as_dict(), "rehash_s": w.get("rehash_s", 0.0),
                     "fill_s": w.get("fill_s"), "write_s": w.get("write_s"), "elapsed_s": w.get("elapsed_s")})
    driver.end()
    print(json.dumps({"model_bytes": R.model_bytes(d), "runs": runs}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before")
    ap.add_argument("--after")
    ap.add_argument("--scale", default="mid")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exports", type=int, default=2)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--child", action="store_true")
    ns = ap.parse_args()
    if ns.child:
        return child(ns)
    res: dict = {"before": [], "after": []}
    for r in range(ns.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            work = tempfile.mkdtemp(prefix="pfc-fp8-order-", dir=ns.dir)
            tree = getattr(ns, side)
            p = subprocess.run([sys.executable, __file__, "--child",
                                "--scale", ns.scale, "--exports", str(ns.exports), "--dir", work],
                               env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
            shutil.rmtree(work, ignore_errors=True)
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            got = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
            res[side].append(got)
            print(side, r, [x["seconds"] for x in got["runs"]], [x["rehash_s"] for x in got["runs"]], flush=True)
    med = {s: statistics.median(x["seconds"] for g in v for x in g["runs"]) for s, v in res.items()}
    print(json.dumps({"scale": ns.scale, "medians": med, "after_over_before": round(med["after"] / med["before"], 3),
                      "results": res}))


if __name__ == "__main__":
    main()
