"""Pure decisions of the callback: whether an event exports, and which snapshots to keep.

No I/O, no collectives: the callback takes the decision on one rank and shares it, so a
rank-local difference (a clock, a float) can never send one rank into a collective alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence


@dataclass(frozen=True)
class Decision:
    export: bool
    reason: str  # the trigger, or why it was skipped
    step: int
    metric: Optional[float] = None


def decide(reason: str, step: int, now: float, last_step: Optional[int], last_time: Optional[float],
           min_interval_s: float, metric_name: Optional[str] = None, metrics: Optional[dict] = None) -> Decision:
    """Whether the event ``reason`` at ``step`` makes a snapshot.

    >>> decide("save", 10, 100.0, 10, 90.0, 0).reason
    'skip: step 10 already exported'
    >>> decide("every_n_steps", 20, 100.0, 10, 95.0, 30).export
    False
    >>> decide("train_end", 20, 100.0, 10, 95.0, 30).export
    True
    """
    metric = metric_value(metrics, metric_name) if metric_name and metrics else None
    if last_step is not None and step == last_step:
        return Decision(False, f"skip: step {step} already exported", step, metric)
    if reason != "train_end" and min_interval_s and last_time is not None and now - last_time < min_interval_s:
        return Decision(False, f"skip: {now - last_time:.1f}s since the last export < min_interval_s={min_interval_s}",
                        step, metric)
    return Decision(True, reason, step, metric)


def metric_value(metrics: Optional[dict], name: str) -> float:
    """The tracked metric from evaluation results; a clear error naming what exists otherwise.

    Accepts ``eval_loss`` or ``loss`` for a trainer that prefixes ``eval_``.
    """
    metrics = metrics or {}
    for key in (name, f"eval_{name}"):
        if key in metrics:
            v = metrics[key]
            try:
                return float(v)
            except (TypeError, ValueError):
                raise ValueError(f"metric {name!r} is {v!r}, not a number") from None
    available = ", ".join(sorted(metrics)) or "(none)"
    raise KeyError(f"retention.metric {name!r} is not in the evaluation results; they have: {available}")


@dataclass(frozen=True)
class Candidate:
    name: str
    step: int
    metric: Optional[float]
    order: int = 0  # commit order (later commits are newer, whatever their step)


def best_of(snapshots: Sequence[Candidate], mode: str) -> Optional[Candidate]:
    """The best snapshot by metric (ties: the newer step); None if none has the metric."""
    scored = [s for s in snapshots if s.metric is not None and not math.isnan(s.metric)]
    if not scored:
        return None
    sign = 1 if mode == "min" else -1
    return min(scored, key=lambda s: (sign * s.metric, -s.step))


def to_remove(snapshots: Sequence[Candidate], keep_last: int, keep_best: int, mode: str,
              protected: Iterable[str] = ()) -> List[str]:
    """Names to delete: not among the newest ``keep_last`` commits, not among the best ``keep_best``,
    not protected.

    With both limits 0 nothing is removed.

    >>> snaps = [Candidate(f"s{i}", i, m) for i, m in enumerate([3.0, 1.0, 2.0, 5.0, 4.0])]
    >>> to_remove(snaps, keep_last=1, keep_best=2, mode="min")
    ['s0', 's3']
    """
    if not keep_last and not keep_best:
        return []
    keep = set(protected)
    by_commit = sorted(snapshots, key=lambda s: (s.order, s.step))
    if keep_last:
        keep |= {s.name for s in by_commit[-keep_last:]}
    if keep_best:
        sign = 1 if mode == "min" else -1
        scored = [s for s in snapshots if s.metric is not None and not math.isnan(s.metric)]
        keep |= {s.name for s in sorted(scored, key=lambda s: (sign * s.metric, -s.step))[:keep_best]}
    return [s.name for s in by_commit if s.name not in keep]
