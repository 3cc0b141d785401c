"""Fault injection for the crash tests: ``PFC_FAULT_POINT=name[@n]`` kills this process with
SIGKILL the n-th time (default 1st) it reaches ``point(name)``; with ``PFC_FAULT_RANK=r`` only on
rank r of a launched job (``PADDLE_TRAINER_ID``); ``PFC_FAULT_SIGNAL=TERM`` (or INT) sends that
signal instead, as a preemption would. In-process tests may set :data:`HOOK` instead, a function
called with the name of every point reached (e.g. to fill the disk at one phase of an export).
Unset (always, outside tests) it costs two comparisons; nothing else reads them.
"""
from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("PFC_FAULT_POINT") or None
if _SPEC and os.environ.get("PFC_FAULT_RANK") not in (None, os.environ.get("PADDLE_TRAINER_ID", "0")):
    _SPEC = None  # the fault is meant for another rank
_NAME, _, _NTH = (_SPEC or "").partition("@")
_COUNT = {"n": 0}
HOOK = None


def point(name: str) -> None:
    if HOOK is not None:
        HOOK(name)
    if _SPEC is None or name != _NAME:
        return
    _COUNT["n"] += 1
    if _COUNT["n"] == int(_NTH or 1):
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("PFC_FAULT_SIGNAL", "KILL")))
