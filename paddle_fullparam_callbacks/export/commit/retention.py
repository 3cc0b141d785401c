"""Snapshots in an output directory, by run: listing, ``best``, retention.

Every snapshot's manifest records the run that committed it (``run.id``) and its place in that
run's commit order (``run.seq``). A job's retention and ``best`` only ever look at its own run's
snapshots (``retention.other_runs: keep``, the default): a new run into a directory that holds
another run's snapshots never deletes them. Within a run, ``keep_last`` keeps the newest
*commits*, so a resumed job that re-exports earlier steps keeps what it just wrote.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from .evaluation import is_running, read_record, tracked_scores
from .ownership import read_manifest, remove_snapshot
from .pointers import POINTERS, read_pointer, write_pointer


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    step: int
    path: Path
    run: Optional[str]  # None: committed by a version that did not record runs
    seq: int  # commit order within its run
    created: float
    metrics: dict
    evaluating: bool = False  # its evaluation (consumers/evaluate/) is running: never removed


def list_snapshots(output_dir: Path, pattern) -> List[SnapshotEntry]:
    """This package's snapshots (directories with its manifest) whose name matches ``pattern``,
    oldest step first."""
    out = []
    if not Path(output_dir).is_dir():
        return out
    for p in Path(output_dir).iterdir():
        m = pattern.match(p.name)
        if not m or not p.is_dir():
            continue
        manifest = read_manifest(p)
        if manifest is None:
            continue
        run = manifest.get("run") if isinstance(manifest.get("run"), dict) else {}
        seq = run.get("seq") if isinstance(run.get("seq"), int) else 0
        created = manifest.get("created_unix") if isinstance(manifest.get("created_unix"), (int, float)) else 0.0
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        metrics = {**metrics, **tracked_scores(p)}  # the evaluation hook's scores, as evaluate.<key>
        out.append(SnapshotEntry(p.name, int(m.group(1)), p, run.get("id"), seq, float(created), metrics,
                                 is_running(read_record(p))))
    out.sort(key=lambda e: (e.step, e.name))
    return out


def newest_run(output_dir: Path, pattern) -> Optional[str]:
    """The run that committed the newest snapshot here (what a resumed job continues)."""
    entries = [e for e in list_snapshots(output_dir, pattern) if e.run]
    return max(entries, key=lambda e: (e.created, e.seq)).run if entries else None


def next_seq(output_dir: Path, pattern, run_id: str) -> int:
    return 1 + max((e.seq for e in list_snapshots(output_dir, pattern) if e.run == run_id), default=0)


def _metric(entry: SnapshotEntry, metric: Optional[str]) -> Optional[float]:
    if not metric:
        return None
    for key in (metric, f"eval_{metric}"):
        v = entry.metrics.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _candidates(output_dir: Path, pattern, metric: Optional[str], run_id: Optional[str], other_runs: str):
    from ...plan.decisions import Candidate

    entries = list_snapshots(output_dir, pattern)
    if other_runs != "delete":
        entries = [e for e in entries if e.run == run_id]
    # commit order: within a run its sequence; across runs (other_runs=delete) the commit time
    order = sorted(entries, key=lambda e: (e.created, e.seq) if other_runs == "delete" else (e.seq, e.created))
    return [Candidate(e.name, e.step, _metric(e, metric), i) for i, e in enumerate(order)]


def update_best(output_dir: Path, pattern, metric: Optional[str], mode: str, run_id: Optional[str] = None,
                other_runs: str = "keep") -> Optional[str]:
    """Point ``best`` at the best snapshot of this run by ``metric``; returns its name."""
    from ...plan.decisions import best_of

    if not metric:
        return None
    best = best_of(_candidates(output_dir, pattern, metric, run_id, other_runs), mode)
    if best is not None and read_pointer(output_dir, "best") != best.name:
        write_pointer(output_dir, "best", best.name)
    return best.name if best else None


def apply_retention(output_dir: Path, pattern, keep_last: int, protect: Iterable[str] = (), keep_best: int = 0,
                    metric: Optional[str] = None, mode: str = "min", run_id: Optional[str] = None,
                    other_runs: str = "keep") -> List[str]:
    """Delete this run's snapshots outside its newest ``keep_last`` commits and its best
    ``keep_best``; never the protected ones (the snapshot being written) or a pointer target."""
    from ...plan.decisions import to_remove

    if keep_last <= 0 and keep_best <= 0:
        return []
    protected = set(protect) | {n for n in (read_pointer(output_dir, p) for p in POINTERS) if n}
    protected |= {e.name for e in list_snapshots(output_dir, pattern) if e.evaluating}
    doomed = to_remove(_candidates(output_dir, pattern, metric, run_id, other_runs), keep_last, keep_best, mode,
                       protected)
    for name in doomed:
        remove_snapshot(Path(output_dir) / name, run_id or "retention")
    return doomed
