"""Start-up cost of the ``paddle-fullparam run`` / ``PADDLE_FULLPARAM_*`` hook in a Python process that
does not train (data preparation, pip, a tool): ``python -c pass``, with and without the hook.

Run (about a minute)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/run_startup.py             # -> bench/results/run_startup.json
    $PY bench/run_startup.py --reps 400

Two fresh venvs made from this Python (standard library only, so that nothing else's ``.pth`` files are
measured), both seeing this checkout through a path file as an installed package would be seen: ``bare``
has nothing else; ``hooked`` also has the wheel's ``paddle_fullparam_callbacks.pth``. The variants run in
interleaved rounds (one process of each per round) and are compared by their medians:

- ``bare`` vs ``wheel_hook_off`` (the .pth, ``PADDLE_FULLPARAM_RECIPE`` unset: what every process of an
  environment with the wheel pays) and ``wheel_hook_on`` (the variable set: the hook loaded and its finder
  installed, what each process of a switched-on job pays);
- ``clone_baseline`` (PYTHONPATH=<checkout>) vs ``clone_run`` (what ``run`` gives a clone's children:
  the hook's folder first on PYTHONPATH, its ``sitecustomize`` loading the hook).

Four estimates of the added cost: the difference of the wall-time medians, the median of the per-round
differences (the two processes of a round ran back to back), the difference of the 10th percentiles
(the quietest runs), and the difference of the medians of each process's own CPU time (user + system,
from ``wait4``); on a machine others are using, the last ones move least.

Also ``run`` itself (once per job): ``run -- python -c pass`` against ``python -c pass``.
``-X importtime`` of the switched-on variants lists every module the hook adds and its cost; the result
asserts none of them is heavy (Paddle, numpy, omegaconf, yaml, this package's ``__init__``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PTH = ROOT / "paddle_fullparam_callbacks" / "trainer" / "autoattach" / "paddle_fullparam_callbacks.pth"
SITEDIR = ROOT / "paddle_fullparam_callbacks" / "trainer" / "autoattach" / "sitedir"
RESULT_PATH = C.RESULTS_DIR / "run_startup.json"
HEAVY = ("paddle", "numpy", "omegaconf", "yaml", "paddle_fullparam_callbacks", "paddleformers", "paddlenlp")
TARGET_MS = 20.0


def _venv(where: Path, with_hook: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_pfc_checkout.pth").write_text(str(ROOT) + "\n")
    if with_hook:
        (site / PTH.name).write_bytes(PTH.read_bytes())
    return py


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def _once(py: Path, env: dict):
    """(wall ms, CPU ms) of one ``python -c pass``: the CPU time (user + system, from wait4) is what the
    process itself spent, less exposed than the wall time to the other work on a shared machine."""
    t0 = time.perf_counter()
    pid = os.posix_spawn(str(py), [str(py), "-c", "pass"], env)
    _, status, usage = os.wait4(pid, 0)
    wall = (time.perf_counter() - t0) * 1e3
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{py} -c pass failed with {env}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1e3


def _imports(py: Path, env: dict) -> dict:
    """{module: cumulative microseconds} of a ``python -X importtime -c pass``."""
    proc = subprocess.run([py, "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True, check=True)
    out = {}
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
            out[name] = int(cumulative)
    return out


def _stats(xs) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 2), "p10_ms": round(xs[len(xs) // 10], 2),
            "p90_ms": round(xs[(9 * len(xs)) // 10], 2), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=C.tiny(200, 3), help="processes per variant (default 200)")
    ap.add_argument("--wrapper-reps", type=int, default=C.tiny(20, 1),
                    help="`run -- python -c pass` repetitions (default 20)")
    ns = ap.parse_args()
    on = {"PADDLE_FULLPARAM_RECIPE": "default"}
    with tempfile.TemporaryDirectory(prefix="pfc-startup-") as tmp:
        bare, hooked = _venv(Path(tmp) / "bare", False), _venv(Path(tmp) / "hooked", True)
        clone_path = {"PYTHONPATH": str(ROOT)}
        run_path = {"PYTHONPATH": os.pathsep.join([str(SITEDIR), str(ROOT)])}
        variants = {
            "bare": (bare, _env()),
            "wheel_hook_off": (hooked, _env()),
            "wheel_hook_on": (hooked, _env(**on)),
            "clone_baseline": (bare, _env(**clone_path)),
            "clone_run": (bare, _env(**run_path, **on)),
        }
        quiet = C.wait_quiet(max_wait=30)
        for py, env in variants.values():  # warm the page cache and the .pyc files
            for _ in range(3):
                _once(py, env)
        times = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        import resource

        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        with C.CpuShare() as share:
            for _ in range(ns.reps):
                for name, (py, env) in variants.items():
                    wall, used = _once(py, env)
                    times[name].append(wall)
                    cpu[name].append(used)
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        # CpuShare counts this process only: the measured processes are its children
        children_cpu = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
        others = max(0.0, share.machine - share.own - children_cpu) / max(1e-9, share.wall * (os.cpu_count() or 1))
        imports = {name: _imports(*variants[name]) for name in variants}
        # `run` itself, once per job: its own start (it imports this package to check the recipe) and its wait
        wrapper = {"direct": [], "through_run": []}
        for _ in range(ns.wrapper_reps):
            wrapper["direct"].append(_once(bare, _env(**clone_path))[0])
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "run", "--", str(bare), "-c", "pass"],
                           env=_env(**clone_path), check=True, capture_output=True)
            wrapper["through_run"].append((time.perf_counter() - t0) * 1e3)
    stats = {name: _stats(xs) for name, xs in times.items()}
    added = {
        "wheel_hook_off_ms": round(stats["wheel_hook_off"]["median_ms"] - stats["bare"]["median_ms"], 2),
        "wheel_hook_on_ms": round(stats["wheel_hook_on"]["median_ms"] - stats["bare"]["median_ms"], 2),
        "clone_run_ms": round(stats["clone_run"]["median_ms"] - stats["clone_baseline"]["median_ms"], 2),
    }
    pairs = {"wheel_hook_off_ms": ("wheel_hook_off", "bare"), "wheel_hook_on_ms": ("wheel_hook_on", "bare"),
             "clone_run_ms": ("clone_run", "clone_baseline")}
    # the same round's two processes ran next to each other: their difference is less exposed to load changes
    paired = {k: round(statistics.median(a - b for a, b in zip(times[v], times[base])), 2)
              for k, (v, base) in pairs.items()}
    at_p10 = {k: round(stats[v]["p10_ms"] - stats[base]["p10_ms"], 2) for k, (v, base) in pairs.items()}
    cpu_stats = {name: _stats(xs) for name, xs in cpu.items()}
    cpu_added = {k: round(cpu_stats[v]["median_ms"] - cpu_stats[base]["median_ms"], 2) for k, (v, base) in pairs.items()}
    extra_modules = {
        "wheel_hook_off": sorted(set(imports["wheel_hook_off"]) - set(imports["bare"])),
        "wheel_hook_on": {m: imports["wheel_hook_on"][m] for m in sorted(set(imports["wheel_hook_on"]) - set(imports["bare"]))},
        "clone_run": {m: imports["clone_run"][m]
                      for m in sorted(set(imports["clone_run"]) - set(imports["clone_baseline"]))},
    }
    heavy = sorted(m for v in ("wheel_hook_on", "clone_run") for m in extra_modules[v]
                   if m.split(".")[0] in HEAVY)
    result = {
        "benchmark": "run_startup", "reps_per_variant": ns.reps, "target_added_ms": TARGET_MS,
        "python_c_pass": stats, "added_median_ms": added, "added_paired_median_ms": paired, "added_p10_ms": at_p10,
        "python_c_pass_cpu": cpu_stats, "added_cpu_median_ms": cpu_added,
        "run_wrapper_once_per_job": {name: _stats(xs) for name, xs in wrapper.items()},
        "within_target": all(v < TARGET_MS for d in (added, paired, cpu_added) for v in d.values()),
        "modules_added_by_the_hook_us_cumulative": extra_modules, "heavy_modules_added": heavy,
        "machine_before": quiet,
        "cpu_while_measuring": {"wall_s": round(share.wall, 2), "machine_cpu_s": round(share.machine, 2),
                                "measured_processes_cpu_s": round(children_cpu, 2),
                                "others_fraction_of_machine": round(others, 3)},
        "notes": ["wall time of a whole `python -c pass` process, started with posix_spawn; medians of "
                  "interleaved rounds on a shared 2-core machine: differences below ~1 ms are noise",
                  "wheel_hook_off: the .pth line reads one environment variable; wheel_hook_on / clone_run: the hook "
                  "(standard library only) is loaded by path and one finder put first on sys.meta_path"],
    }
    C.write_result(RESULT_PATH, result)
    print({k: result[k] for k in ("added_median_ms", "added_paired_median_ms", "added_p10_ms", "added_cpu_median_ms",
                                  "heavy_modules_added", "cpu_while_measuring", "run_wrapper_once_per_job")})
    print(result["modules_added_by_the_hook_us_cumulative"])
    return 0 if not heavy else 1


if __name__ == "__main__":
    sys.exit(main())
