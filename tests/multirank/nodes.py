"""Two "nodes" on one machine: two ``paddle.distributed.launch --nnodes 2`` launches, each in its own
working directory, forming one job (see CPU_CLUSTER.md). Used from pytest, outside the ranks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import LaunchResult, _free_port, store_aborted


def _start(script, args, node: int, master: str, cwd: Path, log_dir: Path, nproc: int, env):
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--master", master, "--nnodes", "2", "--rank", str(node),
           "--nproc_per_node", str(nproc), "--log_dir", str(log_dir), str(script), *[str(a) for a in args]]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def _finish(proc, log_dir: Path, t0: float, timeout: float) -> LaunchResult:
    timed_out, output = False, ""
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                output, _ = proc.communicate(timeout=10)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    logs = {int(f.name.split(".", 1)[1]): f.read_text(errors="replace")
            for f in log_dir.glob("workerlog.*") if f.name.split(".", 1)[1].isdigit()}
    return LaunchResult(proc.returncode, timed_out, time.perf_counter() - t0, str(log_dir), output or "", logs)


def run_two_nodes(script, args, workdirs, nproc: int = 2, timeout: float = 240, env=None):
    """Both nodes' LaunchResults (node 0, node 1); global ranks are node * nproc + local rank. The
    per-rank logs of node 1 are keyed by its global ranks. Retried once on the TCPStore abort."""
    for attempt in range(2):
        master = f"127.0.0.1:{_free_port()}"
        logs = [Path(w) / f"launch-log-{attempt}" for w in workdirs]
        t0 = time.perf_counter()
        procs = [_start(script, args, n, master, Path(workdirs[n]), logs[n], nproc, env) for n in (0, 1)]
        results = [_finish(p, logs[n], t0, timeout) for n, p in enumerate(procs)]
        if attempt == 0 and any(store_aborted(r) for r in results):
            continue
        break
    node1 = results[1]
    node1.logs = {k + nproc if k < nproc else k: v for k, v in node1.logs.items()}
    return results[0], node1
