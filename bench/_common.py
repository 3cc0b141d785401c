"""Shared helpers for the benchmarks in bench/: model building, RSS sampling, machine facts.

Nothing here imports paddle at module import time, so the parent (orchestrating) process of a
benchmark stays light; each measured variant runs in its own child process.

The tiny mode, for every benchmark alike: ``PFC_BENCH_TINY=1`` in the environment (children and
launched ranks inherit it) makes each benchmark run once at its smallest size (``LLAMA_KWARGS`` a
Llama of a few MB, one repetition, one case of each kind, no waiting for idle CPUs) to prove that it
still runs and writes its JSON; ``tests/test_pf_benches.py`` runs them so. Its JSON goes to
``PFC_BENCH_RESULTS`` (a folder; by default ``$TMPDIR/pfc_bench_tiny``), never into bench/results:
``write_json`` refuses that folder in the tiny mode. ``PFC_BENCH_RESULTS`` also moves a real run's
results (``make bench`` leaves it unset: bench/results).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

BENCH_DIR = Path(__file__).resolve().parent
OWN_RESULTS = BENCH_DIR / "results"  # the recorded figures (make bench); never written in the tiny mode
TINY = os.environ.get("PFC_BENCH_TINY", "").strip() not in ("", "0")


def tiny(real, small):
    """``small`` in the tiny mode (``PFC_BENCH_TINY=1``), ``real`` otherwise."""
    return small if TINY else real


def _results_dir() -> Path:
    chosen = os.environ.get("PFC_BENCH_RESULTS", "").strip()
    if chosen:
        return Path(chosen).resolve()
    return Path(tempfile.gettempdir()) / "pfc_bench_tiny" if TINY else OWN_RESULTS


RESULTS_DIR = _results_dir()

# The ~600 MB float32 Llama every single-process benchmark uses (in the tiny mode: 2 layers, hidden 64,
# vocab 512, about 1 MB; 16 heads of 4 as the real one has 16 of 64).
LLAMA_KWARGS = dict(
    vocab_size=tiny(32000, 512),
    hidden_size=tiny(1024, 64),
    intermediate_size=tiny(2816, 176),
    num_hidden_layers=tiny(8, 2),
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=tiny(2048, 128),
    fuse_rms_norm=False,
    tie_word_embeddings=False,
)


def quiet_logs() -> None:
    """Silence the chatty paddle/paddleformers loggers (per-parameter INFO lines would cost time)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("paddleformers", "paddle", "paddlenlp", "paddle_fullparam_callbacks"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # paddleformers has its own logger object
        from paddleformers.utils.log import logger as pf_logger

        pf_logger.set_level("WARNING")
    except Exception:
        pass


def build_llama(seed: int = 0, dtype: str = "float32", device: str = "cpu", layers: Optional[int] = None):
    """PaddleFormers LlamaForCausalLM with LLAMA_KWARGS, deterministic weights, eval mode; built on the
    CPU, then moved to ``device`` (e.g. 'fakedev:0', which also becomes the default place).
    ``layers``: num_hidden_layers instead of LLAMA_KWARGS' 8 (51 MB each in float32, 262 MB of
    embeddings besides: 21 layers make twice the 673 MB model)."""
    import paddle

    paddle.set_device("cpu")
    paddle.set_default_dtype(dtype)
    paddle.seed(seed)
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(LLAMA_KWARGS) if layers is None else dict(LLAMA_KWARGS, num_hidden_layers=layers)
    model = LlamaForCausalLM(LlamaConfig(**kwargs))
    model.eval()
    if device != "cpu":
        paddle.set_device(device)
        model.to(device=device)
    return model


def parameter_bytes(model) -> int:
    """Total bytes of the model's parameters (each parameter object counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += int(p.numel()) * p.element_size()
    return total


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def ru_maxrss_bytes() -> int:
    """Peak RSS of this process over its whole life (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Samples this process's RSS in a background thread every ``interval`` seconds.

    Use as a context manager around the timed region: ``baseline`` is read on entry, ``peak``
    is the largest sample seen (entry and exit included).
    """

    def __init__(self, interval: float = 0.002):
        import psutil

        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.baseline = 0
        self.peak = 0
        self.samples = 0

    def _sample(self) -> None:
        rss = self._proc.memory_info().rss
        if rss > self.peak:
            self.peak = rss
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)


def trim_heap() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``), so that RSS counts live memory.

    Memory freed while building the model may otherwise stay resident, and a later allocation
    would reuse it without raising RSS, hiding it from the "peak extra RSS" of the timed region.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def wait_quiet(max_wait: float = 60.0, busy_below: float = 15.0, window: float = 1.0) -> dict:
    """Wait (at most ``max_wait`` s) until the machine's CPUs are idle: less than ``busy_below``
    percent busy over ``window`` s. Other work on a shared 2-core machine (someone else's tests)
    otherwise lands in whichever variant runs beside it. Returns what it saw, for the record.
    In the tiny mode it looks once, briefly, and does not wait."""
    import psutil

    if TINY:
        max_wait, window = 0.0, 0.05

    t0 = time.perf_counter()
    busy = 100.0
    while True:
        busy = 100.0 - psutil.cpu_times_percent(interval=window).idle
        waited = time.perf_counter() - t0
        if busy < busy_below or waited >= max_wait:
            return {"waited_s": round(waited, 1), "busy_percent": round(busy, 1), "quiet": busy < busy_below}


class CpuShare:
    """How much of the machine's CPU others used while a region ran (context manager).

    ``foreign_fraction`` = (CPU seconds of the whole machine - this process's own, all threads, and its
    waited-for children's, e.g. a ``cp`` it ran) / (wall seconds x CPUs). On a shared 2-core machine someone else's work lands in whichever
    variant runs beside it; the benchmarks repeat a run that others disturbed. (Kernel threads
    writing this process's pages back count as others; /proc/stat counts in 10 ms ticks.)
    """

    @staticmethod
    def _machine_busy() -> float:
        import psutil

        t = psutil.cpu_times()  # guest time is inside user already; steal (the host's neighbours) counts
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    @staticmethod
    def _own() -> float:
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    def __enter__(self) -> "CpuShare":
        self._m0, self._o0, self._t0 = self._machine_busy(), self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        self.machine = self._machine_busy() - self._m0
        self.own = self._own() - self._o0
        self.foreign = max(0.0, self.machine - self.own)
        self.foreign_fraction = self.foreign / max(1e-9, self.wall * (os.cpu_count() or 1))

    def as_dict(self) -> dict:
        return {"wall_s": round(self.wall, 4), "machine_cpu_s": round(self.machine, 3), "own_cpu_s": round(self.own, 3),
                "foreign_fraction": round(self.foreign_fraction, 3)}


def parameter_arrays(model, dtype: Optional[str] = None) -> list:
    """The model's parameters (each object once) as contiguous host arrays, optionally cast
    (``bfloat16`` as its uint16 bits, as Paddle rounds): the bytes a raw writer writes."""
    import numpy as np

    seen, arrays = set(), []
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if dtype is not None and str(p.dtype).endswith("float32"):
            import paddle

            q = p.detach().astype(dtype)
            arrays.append(np.ascontiguousarray((q.view(paddle.uint16) if dtype == "bfloat16" else q).numpy()))
        else:
            arrays.append(np.ascontiguousarray(p.numpy()))
    return arrays


def median(xs: List[float]) -> float:
    return float(statistics.median(xs))


def tree_bytes(path: "str | os.PathLike") -> Dict[str, int]:
    """{relative file path: size} of every file under ``path``."""
    root = Path(path)
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def machine_info() -> dict:
    import psutil

    info = {
        "nproc": os.cpu_count(),
        "total_ram_bytes": psutil.virtual_memory().total,
        "total_ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if TINY:  # the versions the environment installed, without a process that imports Paddle
        from importlib import metadata

        for key, dist in (("paddle", "paddlepaddle"), ("paddleformers", "paddleformers"), ("numpy", "numpy"),
                          ("safetensors", "safetensors")):
            try:
                info[key] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                info[key] = None
        return info
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import paddle, paddleformers, numpy, safetensors;"
             "print(paddle.__version__, paddleformers.__version__, numpy.__version__, safetensors.__version__)"],
            capture_output=True, text=True, timeout=120,
        ).stdout.split()
        info.update(dict(zip(("paddle", "paddleformers", "numpy", "safetensors"), out[-4:])))
    except Exception as e:  # informational only
        info["versions_error"] = str(e)
    return info


def git_commit() -> str:
    """HEAD of the repository holding bench/, with '+dirty' if the package has local changes."""
    repo = BENCH_DIR.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "paddle_fullparam_callbacks"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def write_json(path: Path, obj: dict) -> None:
    path = Path(path)
    if TINY and path.resolve().is_relative_to(OWN_RESULTS.resolve()):
        raise SystemExit(f"PFC_BENCH_TINY is set: a tiny run writes no figures into {OWN_RESULTS} (asked for "
                         f"{path}); set PFC_BENCH_RESULTS to another folder")
    if TINY:
        obj["tiny"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_result(path: Path, result: dict) -> None:
    """A benchmark's result, stamped with the machine, the package's commit and the date."""
    result.update(machine=machine_info(), package_commit=git_commit(), date=now_iso())
    write_json(path, result)


class MissingInput(SystemExit):
    """A benchmark's input (another benchmark's JSON, a key in it, a tree to compare with) is not there: the
    benchmark stops with a message naming it and what makes it (never figures of its own in its place)."""


def read_input(name: str, *keys, made_by: str = ""):
    """``RESULTS_DIR/name``'s JSON, or the value at ``keys`` in it; a :class:`MissingInput` naming the file, the key
    and ``made_by`` (the benchmark that writes it) when either is missing.

    >>> try:
    ...     read_input("no_such.json", made_by="bench/nothing.py")
    ... except MissingInput as e:
    ...     print("no_such.json is missing (bench/nothing.py writes it" in str(e))
    True
    """
    path = RESULTS_DIR / name
    hint = f" ({made_by} writes it; run it first, or point PFC_BENCH_RESULTS at its results)" if made_by else ""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MissingInput(f"{Path(sys.argv[0]).name}: input {path} is missing{hint}: {type(e).__name__}: {e}") from e
    for i, k in enumerate(keys):
        try:
            value = value[k]
        except (KeyError, IndexError, TypeError) as e:
            at = "".join(f"[{x!r}]" for x in keys[:i + 1])
            raise MissingInput(f"{Path(sys.argv[0]).name}: input {path} has no {at}{hint}") from e
    return value


def existing_tree(path) -> Path:
    """An argument naming another checkout (``--before``): it must hold the package, else a MissingInput."""
    tree = Path(path).resolve()
    if not (tree / "paddle_fullparam_callbacks" / "__init__.py").is_file():
        raise MissingInput(f"{Path(sys.argv[0]).name}: {tree} is not a checkout of this package "
                           "(no paddle_fullparam_callbacks/__init__.py)")
    return tree


def run_child(argv: List[str], timeout: float = 900, env: Optional[dict] = None) -> dict:
    """Run ``python argv...`` in a fresh process (``env``: its environment, default this one's); its last
    stdout line must be a JSON object."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + "\n" + proc.stderr[-8000:])
        raise RuntimeError(f"child {argv} exited with {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        sys.stderr.write(proc.stdout[-4000:] + "\n" + proc.stderr[-8000:])
        raise RuntimeError(f"child {argv} printed no JSON result")
    result = json.loads(lines[-1])
    result["process_seconds"] = time.perf_counter() - t0
    return result


def best_ns_per_element(fn, n: int, reps: int, digits: int = 3) -> float:
    """ns per element of the fastest of ``reps`` calls of ``fn`` (after one warm-up call) over ``n`` elements."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(min(ts) / n * 1e9, digits)


DISTURBED = 0.2  # others used more than this share of the CPUs during a run: it is repeated
RETRIES = tiny(3, 1)


def least_disturbed_child(argv_for, prefix: str, folder: Optional[str], quiet_wait: float, timeout: float = 900,
                          loadavg: bool = False) -> dict:
    """A child run (``argv_for(out)``: its argv, writing into ``out``) in a fresh temporary folder under ``folder``,
    after a sync and a wait for idle CPUs; repeated up to ``RETRIES`` times while others used more than
    ``DISTURBED`` of the CPUs during it. The least disturbed try, with ``quiet`` (and ``loadavg_1m``) and the
    others' ``disturbed_tries``."""
    import shutil

    tries = []
    for _ in range(RETRIES):
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
        try:
            os.sync()
            q = wait_quiet(quiet_wait)
            if loadavg:
                q["loadavg_1m"] = round(os.getloadavg()[0], 2)
            r = run_child(argv_for(tmp / "out"), timeout=timeout)
            r["quiet"] = q
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        tries.append(r)
        if r["cpu"]["foreign_fraction"] <= DISTURBED:
            break
    best = min(tries, key=lambda x: x["cpu"]["foreign_fraction"])
    best["disturbed_tries"] = [t["cpu"]["foreign_fraction"] for t in tries if t is not best]
    return best


def profile_top(stats, key: str, n: int, digits: int = 3) -> list:
    """The top ``n`` functions of a ``pstats.Stats`` by ``key``, as JSON-able rows."""
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:n]:
        _cc, nc, tt, ct, _ = stats.stats[func]
        rows.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "ncalls": nc,
                     "tottime": round(tt, digits), "cumtime": round(ct, digits)})
    return rows


def timed_export(model, overrides: List[str], step: int = 1):
    """One export of ``model`` in this process (``ExportSession``, a recipe of ``overrides`` with its output_dir),
    timed and RSS-sampled as the single-process benchmarks measure it: the export alone, after the heap is
    trimmed. Returns (info, seconds, RssSampler, CpuShare, config)."""
    import gc

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, overrides)
    session = ExportSession(cfg, cfg.output_dir)
    session.start()
    source = build_model_source(model, cfg)
    gc.collect()
    trim_heap()
    with RssSampler(0.002) as rss, CpuShare() as cpu:
        t0 = time.perf_counter()
        info = session.export(source, step=step)
        seconds = time.perf_counter() - t0
    session.close()
    return info, seconds, rss, cpu, cfg


def record_writer_stats() -> list:
    """From now on every ``SnapshotWriter.close`` appends the writer's ``stats.snapshot()`` to the
    returned list (the per-thread breakdown of each export, for the benchmark's report)."""
    from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter

    recorded: list = []
    real_close = SnapshotWriter.close

    def close(self):
        files = real_close(self)
        recorded.append(self.stats.snapshot())
        return files

    SnapshotWriter.close = close
    return recorded


class TrainingWork:
    """A stand-in for a training step's compute: float32 matrix products on every core, of a fixed amount
    (the stall benchmarks run it between exports, draining a consumer's hook after each step)."""

    def __init__(self, n: int = 768):
        import numpy as np

        self.np, self.a = np, np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)

    def step(self) -> None:
        b = self.a
        for _ in range(6):
            b = b @ self.a
            b /= self.np.abs(b).max()
