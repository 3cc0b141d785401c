"""Tiny fake evaluators for the evaluation hook's tests, written by each test into its tmp_path.

``fake_evaluator(tmp_path, plan)`` writes one script and its plan (JSON) and returns the
``evaluate.command`` that runs it. What the script does for a snapshot is chosen by its step in
``plan["by_step"]`` (default ``plan["default"]``, else ``ok``):

- ``ok``: writes ``{"score": scores[step] (default 100/step), "step": step, "nice": <its niceness>}`` to ``{output}``;
- ``stdout``: prints that object as its last line instead (and nothing to ``{output}``);
- ``crash``: prints ``boom`` on stderr, exits 3;
- ``garbage``: writes ``not json {`` to ``{output}``;
- ``list``: writes a JSON list (not an object);
- ``hang``: sleeps an hour (for timeouts and the end of training);
- ``gate``: waits for the file ``plan["gate"]`` to exist (``{step}`` in it replaced by the step), then does ``ok``.

Every call appends ``{"step", "pid", "rank", "nice", "autogroup", "snapshot"}`` to ``plan["calls"]`` first
(``autogroup``: ``/proc/self/autogroup``, e.g. ``/autogroup-12 nice 10``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SCRIPT = r'''
import json, os, sys, time
snapshot, step, output, plan_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
plan = json.load(open(plan_path))
with open(plan["calls"], "a") as f:
    try:
        group = open("/proc/self/autogroup").read().strip()
    except OSError:
        group = None
    f.write(json.dumps({"step": step, "pid": os.getpid(), "rank": os.environ.get("PADDLE_TRAINER_ID"),
                        "nice": os.nice(0), "autogroup": group, "snapshot": snapshot}) + "\n")
what = plan.get("by_step", {}).get(str(step), plan.get("default", "ok"))
if what == "gate":
    deadline = time.monotonic() + 600  # a test that never opens the gate leaves no process behind for long
    while not os.path.exists(plan["gate"].replace("{step}", str(step))):
        if time.monotonic() > deadline:
            sys.exit("the gate never opened")
        time.sleep(0.02)
    what = "ok"
result = {"score": plan.get("scores", {}).get(str(step), 100.0 / max(step, 1)), "step": step, "nice": os.nice(0)}
if what == "ok":
    print("evaluating", snapshot, file=sys.stderr)
    with open(output, "w") as f:
        json.dump(result, f)
elif what == "stdout":
    print("some progress line")
    print(json.dumps(result))
elif what == "crash":
    print("boom", file=sys.stderr)
    sys.exit(3)
elif what == "garbage":
    with open(output, "w") as f:
        f.write("not json {")
elif what == "list":
    with open(output, "w") as f:
        f.write("[1, 2]")
elif what == "hang":
    time.sleep(3600)
'''


def fake_evaluator(tmp_path: Path, plan: dict, name: str = "fake_eval") -> str:
    """Write the script and ``plan``; return an ``evaluate.command``."""
    tmp_path = Path(tmp_path)
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT)
    plan = {"calls": str(tmp_path / f"{name}.calls"), **plan}
    plan_path = tmp_path / f"{name}.json"
    plan_path.write_text(json.dumps(plan))
    return f"{{python}} {script} {{snapshot}} {{step}} {{output}} {plan_path}"


def calls(tmp_path: Path, name: str = "fake_eval") -> list:
    path = Path(tmp_path) / f"{name}.calls"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def python_override() -> str:
    """evaluate.python for the fakes: this interpreter (any would do)."""
    return f"evaluate.python={sys.executable}"


def wait_until(condition, what: str, timeout_s: float = 120.0, every_s: float = 0.02) -> None:
    """Poll ``condition()`` until it is true; after ``timeout_s``, fail the test naming ``what`` (a wait
    in a test never hangs the suite)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(every_s)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stop_leftovers(tmp_path: Path, name: str = "fake_eval") -> None:
    """After a test (failed or not): the fake evaluators it started that still run are stopped (their
    process groups), so that no test leaves a process behind."""
    import signal

    for call in calls(tmp_path, name):
        if alive(call["pid"]):
            try:
                os.killpg(call["pid"], signal.SIGKILL)
            except OSError:
                pass


class Recorder:
    """Another callback of the trainer: what went through trainer.log, and a function per step."""

    def __init__(self, at_step=None):
        self.logs, self.at_step = [], at_step or {}

    def __getattr__(self, attr):
        if attr.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(attr)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and any(k.startswith("fullparam/eval/") for k in logs):
            self.logs.append({k: v for k, v in logs.items() if k.startswith("fullparam/eval/")})

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.at_step:
            self.at_step[state.global_step]()
