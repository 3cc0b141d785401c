"""The runner: one process per job on a committed snapshot, between the training job and the program that
does the work: the evaluator of the evaluation hook (``evaluate/``), or the publisher (``publish/``: the
S3 upload process, or ``publish.command``). One runner serves every consumer of snapshots (``hook.py``
starts it).

    python -I runner.py WORKDIR        (WORKDIR = <snapshot>/.fullparam-eval or .fullparam-publish, holding spec.json)

Started by a hook in a session of its own, so it outlives a training job that is killed: it lowers
its CPU priority (``os.nice``, and its session's autogroup: see :func:`lower_priority`), starts the
program (the spec's ``argv``) in a process group of its own (in the same session) with its stdout and
stderr going to the snapshot's log file, stops that group on timeout (SIGTERM, then SIGKILL) or when
it is told to stop (SIGTERM: the training ended), and writes what happened to ``WORKDIR/status.json``
(atomically): exit code, timeout, the last line the program printed. Turning that into the snapshot's
record is the hook's job, done by the hook, or by the next start of a job whose process died meanwhile.

Only the standard library: it starts in a few milliseconds under any interpreter.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

STATUS = "status.json"
EVALUATOR_PID = "evaluator.pid"
LAST_LINE_MAX = 65536
KILL_GRACE_S = 5.0


def _write_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Stopper:
    """Stops the evaluator's process group once: SIGTERM, then SIGKILL after a grace period."""

    def __init__(self):
        self.proc = None
        self.why = None  # "timeout" | "terminated"
        self._lock = threading.Lock()

    def stop(self, why: str) -> None:
        with self._lock:
            if self.why is not None:
                return
            self.why = why
        threading.Thread(target=self._kill, daemon=True).start()

    def _kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                proc.wait(timeout=KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue


def lower_priority(n: int) -> None:
    """``os.nice(n)``, and the same nice value for this session's autogroup. Linux (with
    ``kernel.sched_autogroup_enabled``, the default of most distributions) schedules each session
    as a group: the runner, in a session of its own, would compete with the whole training job as
    an equal, whatever its nice value (measured by bench/eval_stall.py: a nice-10 evaluator slowed
    training as much as a nice-0 one). The group's own nice value restores the intent."""
    if n <= 0:
        return
    try:
        os.nice(n)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(n))
    except OSError:  # no autogroup (another OS, or the feature off): nice alone applies
        pass


def run(workdir: str) -> dict:
    with open(os.path.join(workdir, "spec.json")) as f:
        spec = json.load(f)
    lower_priority(int(spec.get("nice", 0)))
    status = {"runner_pid": os.getpid(), "started_unix": time.time(), "exit_code": None, "timed_out": False,
              "terminated": False, "last_line": "", "error": None}
    stopper = _Stopper()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopper.stop("terminated"))
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    with open(spec["log"], "wb") as log:
        try:
            # its own process group (to stop it and its children together), in this session: same autogroup
            group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
            proc = subprocess.Popen(spec["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                    env=env, cwd=spec.get("cwd") or None, **group)
        except (OSError, ValueError) as e:
            status["error"] = f"cannot start {spec['argv'][0]!r}: {getattr(e, 'strerror', None) or e}"
            log.write(f"paddle-fullparam: {status['error']}\n".encode())
            return _finish(workdir, status)
        stopper.proc = proc
        _write_atomic(os.path.join(workdir, EVALUATOR_PID), {"pid": proc.pid})
        if stopper.why == "terminated":  # told to stop while starting
            stopper.why = None
            stopper.stop("terminated")
        timer = threading.Timer(float(spec["timeout_s"]), stopper.stop, args=("timeout",))
        timer.daemon = True
        timer.start()
        last = b""
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            log.flush()
            if line.strip():
                last = line[-LAST_LINE_MAX:]
        code = proc.wait()
        timer.cancel()
    status.update(exit_code=code, timed_out=stopper.why == "timeout", terminated=stopper.why == "terminated",
                  last_line=last.decode("utf-8", errors="replace").strip())
    return _finish(workdir, status)


def cmdline(pid) -> list:
    """The arguments process ``pid`` runs with, on this host (``/proc``); [] for no such process."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return []
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def is_alive(pid, workdir: str) -> bool:
    """Whether ``pid`` is a runner (this file) working on ``workdir``, on this host (``/proc``)."""
    args = cmdline(pid)
    return os.path.basename(__file__).encode() in b" ".join(args) and os.fsencode(str(workdir)) in args


def find(workdir: str):
    """The pid of a runner working on ``workdir`` on this host, or None (for a job that died between
    starting its runner and recording its pid)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    return next((p for p in pids if p != os.getpid() and is_alive(p, workdir)), None)


def _finish(workdir: str, status: dict) -> dict:
    status["finished_unix"] = time.time()
    status["seconds"] = round(status["finished_unix"] - status["started_unix"], 3)
    _write_atomic(os.path.join(workdir, STATUS), status)
    return status


if __name__ == "__main__":
    run(sys.argv[1])
