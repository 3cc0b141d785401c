"""How bench/results/fp8_chunks.json was measured (kept beside it; not a benchmark of `make bench`).

Paired A/B of the FP8 fill's chunk: copies of the package that differ only in ``host/quantize.py`` ``_CHUNK`` and
``host/fp8.py`` ``_SUB``, each running ``bench/real_layers.py --child fp8`` (one whole export of one layer, tmpfs),
interleaved, the order reversed every other repetition. From the repository's root:

    PY=$(scripts/env.sh paddleformers) ; $PY bench/results/fp8_chunks_ab.py "$PY" qwen2.5-7b,llama-3-8b 4 64,128,256
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tree(root: Path, k: str) -> Path:
    t = root / f"t{k}"
    shutil.copytree(REPO / "paddle_fullparam_callbacks", t / "paddle_fullparam_callbacks")
    for rel, name in (("host/quantize.py", "_CHUNK"), ("host/fp8.py", "_SUB")):
        p = t / "paddle_fullparam_callbacks" / rel
        src, n = re.subn(rf"^{name} = .*$", f"{name} = {k} * 2**10", p.read_text(), flags=re.M)
        assert n == 1, (rel, name)
        p.write_text(src)
    return t


def main() -> None:
    py, layers, reps, ks = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4].split(",")
    root = Path(tempfile.mkdtemp(prefix="pfc-chunks-"))
    trees = {k: tree(root, k) for k in ks}
    res: dict = {}
    for layer in layers:
        for rep in range(reps):
            for k in (ks if rep % 2 == 0 else ks[::-1]):
                out = root / "out"
                shutil.rmtree(out, ignore_errors=True)
                p = subprocess.run([py, str(REPO / "bench/real_layers.py"), "--child", "fp8", "--layer", layer,
                                    "--out", str(out)], env=dict(os.environ, PYTHONPATH=str(trees[k])),
                                   capture_output=True, text=True, check=True)
                r = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
                ws = r.get("writer_stats", {})
                res.setdefault(layer, {}).setdefault(k, []).append(
                    (r["seconds"], r["cpu"].get("own_cpu_s"), ws.get("fill_s"), ws.get("rehash_s")))
                print(layer, k, rep, round(r["seconds"], 3), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    for layer, d in res.items():
        for k, v in d.items():
            print(layer, k, "median s", round(statistics.median(x[0] for x in v), 3))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
