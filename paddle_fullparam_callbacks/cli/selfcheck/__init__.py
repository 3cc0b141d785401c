"""``paddle-fullparam selfcheck [--device TYPE] [--nproc N]``: prove a machine before a long run.

Launches ``job.py`` on N ranks of the given device (``paddle.distributed.launch``), in a hybrid topology
formed from N (tensor parallel 2 where N is even, pipeline 2 where what is left is even, data
parallel for the rest), exports a small model twice (its own dtype and bfloat16) with a device memory
budget smaller than its largest tensors, and checks here, with numpy alone, that every byte of both
snapshots equals an independent assembly of the shards the ranks dumped (and the values the model was
built with). Prints what it ran on and PASS or FAIL; exit status 0 or 1.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

BUDGET = "256KB"  # smaller than the model's embedding and head (512 KB each): they move in chunks


def layout(n: int) -> Tuple[int, int, int]:
    """(mp, pp, dp) for n ranks: tensor parallel first, then pipeline, the rest data parallel.

    >>> [layout(n) for n in (1, 2, 3, 4, 6, 8)]
    [(1, 1, 1), (2, 1, 1), (1, 1, 3), (2, 2, 1), (2, 1, 3), (2, 2, 2)]
    """
    mp = 2 if n % 2 == 0 else 1
    pp = 2 if (n // mp) % 2 == 0 else 1
    return mp, pp, n // (mp * pp)


def detect_device(wanted: Optional[str]) -> Tuple[str, int, str]:
    """(device type, how many this machine has, Paddle's version) for ``--device`` (None: the first
    accelerator Paddle sees, else cpu)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Paddle's import warns about ccache, irrelevant here
        import paddle

    customs = list(paddle.device.get_all_custom_device_type() or [])
    kind = wanted
    if kind is None:
        kind = ("gpu" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count()
                else customs[0] if customs else "xpu" if paddle.is_compiled_with_xpu() else "cpu")
    if kind == "cpu":
        count = os.cpu_count() or 1
    elif kind == "gpu":
        count = paddle.device.cuda.device_count() if paddle.is_compiled_with_cuda() else 0
    elif kind == "xpu":
        count = paddle.device.xpu.device_count() if paddle.is_compiled_with_xpu() else 0
    elif kind in customs:
        count = sum(1 for d in paddle.device.get_available_custom_device() if d.split(":")[0] == kind)
    else:
        count = 0
    return kind, count, paddle.__version__


def _launch(kind: str, nproc: int, work: Path, extra: List[str], timeout: float) -> Tuple[int, float, bool]:
    mp, pp, dp = layout(nproc)
    job = Path(__file__).with_name("job.py")
    devices = ["--nproc_per_node", str(nproc)] if kind == "cpu" else ["--devices", ",".join(map(str, range(nproc)))]
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", str(work / "log"), *devices, *extra,
           str(job), "--device", kind, "--out", str(work), "--budget", BUDGET,
           "--mp", str(mp), "--pp", str(pp), "--dp", str(dp)]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])  # the ranks import this copy of the package
    env["PYTHONPATH"] = os.pathsep.join([package_root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    t0 = time.perf_counter()
    with open(work / "launch.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    return rc, time.perf_counter() - t0, timed_out


def _reports(work: Path) -> List[dict]:
    out = []
    for f in sorted((work / "log").glob("workerlog.*")):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("SELFCHECK "):
                out.append(json.loads(line[len("SELFCHECK "):]))
    return sorted(out, key=lambda r: (r.get("rank") is None, r.get("rank") or 0))


def _read_snapshot(path: Path) -> Dict[str, Tuple[str, bytes]]:
    """{name: (safetensors dtype code, bytes)} of every tensor, read from the files with json alone."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        data = f.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        for name, e in header.items():
            if name != "__metadata__":
                a, b = e["data_offsets"]
                out[name] = (e["dtype"], data[8 + n + a:8 + n + b])
    return out


def _expected(work: Path) -> Dict[str, "object"]:
    """Every parameter assembled from the ranks' dumps with numpy, checked against the reference values."""
    import numpy as np

    from .model import global_shapes, reference

    shapes, full, filled = global_shapes(), {}, {}
    for meta_file in sorted((work / "shards").glob("rank-*.json")):
        arrays = np.load(meta_file.with_suffix(".npz"))
        for slot, (key, offset, gshape) in json.loads(meta_file.read_text()).items():
            piece = arrays[slot]
            box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
            full.setdefault(key, np.zeros(gshape, np.float32))[box] = piece
            filled.setdefault(key, np.zeros(gshape, bool))[box] = True
    problems = [k for k in shapes if k not in full or not filled[k].all()]
    problems += [k for k in full if not np.array_equal(full[k], reference(k, shapes[k]))]
    if problems:
        raise AssertionError(f"the ranks' shards do not form the model: {sorted(problems)[:5]}")
    return full


def _check(work: Path, reports: List[dict]) -> List[str]:
    """Problems found (empty: PASS)."""
    from .model import bfloat16_bits

    try:
        full = _expected(work)
    except AssertionError as e:
        return [str(e)]
    from ...export.verify import verify_snapshot

    problems = []
    for i, dtype in enumerate(("keep", "bfloat16")):
        snap = Path(reports[0]["exports"][i]["snapshot"])
        report = verify_snapshot(snap)
        if not report.ok:
            problems.append(f"{dtype}: verify: {report.errors[:3]}")
        got = _read_snapshot(snap)
        want = {k: (("BF16", bfloat16_bits(v).tobytes()) if dtype == "bfloat16" else ("F32", v.tobytes()))
                for k, v in full.items()}
        if set(got) != set(want):
            problems.append(f"{dtype}: tensors {sorted(set(got) ^ set(want))[:5]} differ between snapshot and model")
        bad = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        if bad:
            problems.append(f"{dtype}: {len(bad)} tensor(s) with other bytes than the shards: {bad[:5]}")
    return problems


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"


def run_selfcheck(device: Optional[str], nproc: Optional[int], keep: Optional[str], timeout: float,
                  launch_args: List[str]) -> int:
    from ...config.sizes import parse_size

    if nproc is not None and nproc < 1:
        print(f"paddle-fullparam selfcheck: --nproc must be a whole number >= 1; got {nproc}", file=sys.stderr)
        return 2
    kind, count, version = detect_device(device)
    n = nproc or (4 if kind == "cpu" else min(count, 8))
    print(f"paddle-fullparam selfcheck: Paddle {version}, device {kind} ({count} on this machine), {n} rank(s)")
    if kind != "cpu" and count < n:
        print(f"FAIL: {n} rank(s) need {n} {kind} device(s); this machine has {count}")
        return 1
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="pfc-selfcheck-"))
    work.mkdir(parents=True, exist_ok=True)
    mp, pp, dp = layout(n)
    print(f"  topology     {n} rank(s): mp{mp} x pp{pp} x dp{dp} (fleet.init on the device's own backend)")
    rc, seconds, timed_out = _launch(kind, n, work, launch_args, timeout)
    reports = _reports(work)
    errors = [f"rank {r.get('rank')}: {r['error']}" for r in reports if r.get("error")]
    if timed_out:
        errors.insert(0, f"the launch did not finish within {timeout:.0f} s")
    elif len(reports) != n and not errors:
        errors.append(f"{len(reports)} of {n} rank(s) reported (launcher exit status {rc}); see {work / 'log'}")
    if not errors:
        r0 = reports[0]
        print(f"  backends     training: {r0['backend'] or '?'} (fleet groups); export: gloo groups over host memory")
        print(f"  parameters   on {', '.join(r0['params_on'])}")
        for i, e in enumerate(r0["exports"]):
            peaks = [r["exports"][i]["device_peak"] for r in reports]
            peak = None if any(p is None for p in peaks) else max(peaks)
            where = ("no device memory statistics on cpu" if peak is None
                     else f"device peak {_fmt_bytes(peak)} above the parameters (budget {BUDGET})")
            print(f"  export       {e['dtype']:<8} {e['tensors']} tensors, {_fmt_bytes(e['bytes'])} in {e['seconds']:.2f} s; "
                  f"{where}")
            if peak is not None and peak > parse_size(BUDGET):
                errors.append(f"{e['dtype']}: the export allocated {peak} bytes on a device, over its budget {BUDGET}")
        errors += _check(work, reports)
        if not errors:
            print("  bytes        both snapshots equal, bit for bit, an independent numpy assembly of the ranks' shards")
    print(f"  launch       {seconds:.1f} s in all")
    for e in errors:
        print(f"  error        {e}")
    print("PASS" if not errors else f"FAIL (snapshots and rank logs kept in {work})")
    if not errors and not keep:
        shutil.rmtree(work, ignore_errors=True)
        print(f"  (removed {work}; --keep DIR keeps the snapshots and logs)")
    return 0 if not errors else 1


def add_parser(sub) -> None:
    text = "launch a small hybrid-parallel model on this machine's devices, export it and check every byte (PASS/FAIL)"
    s = sub.add_parser("selfcheck", help=text, description=text + "; exit 0 PASS, 1 FAIL. Run it before a long job.")
    s.add_argument("--device", help="cpu, gpu, xpu or a custom device type (default: the first accelerator, else cpu)")
    s.add_argument("--nproc", type=int, help="ranks to launch (default: every device, at most 8; 4 on cpu)")
    s.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds before the launch is stopped (default 600)")
    s.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                   help="passed to paddle.distributed.launch (repeat it), e.g. --launch-arg=--master=10.0.0.1:8090")
    s.set_defaults(func=lambda ns: run_selfcheck(ns.device, ns.nproc, ns.keep, ns.timeout, ns.launch_arg))
