"""Snapshots an engine keeps serving until their evaluation is over (``evaluate.lm_eval.engine_hold``).

The lm-eval evaluator's engine backend scores a snapshot only while the engine serves it; with training faster
than scoring, the next swap would move the engine on first and the evaluation would be discarded. So the evaluation
hook :meth:`~Holds.hold` s a snapshot when its evaluation is put in line and :meth:`~Holds.release` s it when the
evaluation has ended (scored, discarded, failed, or never started); the serving hook's next swap waits while an
engine serves a held snapshot (``serve/hook.py``), and then serves the newest snapshot waiting. Both hooks are the
coordinator's, in one process: this is a set behind a lock, and a callback per release. Training never waits on it.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, List


class Holds:
    """Snapshot names held (a count each: the same snapshot evaluated again holds it again)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: Counter = Counter()
        self._listeners: List[Callable[[], None]] = []

    def hold(self, name: str) -> None:
        with self._lock:
            self._held[name] += 1

    def release(self, name: str) -> None:
        with self._lock:
            if self._held[name] <= 1:
                self._held.pop(name, None)
            else:
                self._held[name] -= 1
            listeners = list(self._listeners)
        for fn in listeners:  # outside the lock: a listener takes its own
            fn()

    def held(self, name: str) -> bool:
        with self._lock:
            return self._held[name] > 0

    def on_release(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after every release (the serving hook wakes its worker)."""
        with self._lock:
            self._listeners.append(fn)
