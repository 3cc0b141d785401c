"""What earlier jobs' swaps left, settled when a job starts (or before ``paddle-fullparam serve``).

A swap runs in the job's swap agent, in a session of its own, so a training job that is killed does not stop
it. For each snapshot whose serve record still says ``running``:

- its agent alive and still swapping: the new job's hook adopts it (watches it, records it when it ends);
- otherwise: recorded from what the agent left (the outcome per engine, if it got that far), else as failed.

Either way no older snapshot is swapped again: an engine needs only the newest weights, which the next commit
(or, when an engine was left paused or its weights unknown, the newest snapshot at once) brings.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ...export.commit.ownership import delete_marked, is_marked
from ..hook import settle_left
from . import records
from .agent import OUTPUT
from .hook import ServeHook, Serving, agent_works
from .engines import Target
from .result import final_entries


def recover(hook: Optional[ServeHook], snapshots: Iterable[Tuple[str, int, Path]],
            urls: List[str]) -> Dict[str, List[Serving]]:
    """Settle ``snapshots`` ((name, step, path)); returns {"settled", "adopted"}; with a hook, the adopted ones
    are submitted to it (watched until they end)."""
    out: Dict[str, List[Serving]] = {"settled": [], "adopted": []}
    for name, step, path in snapshots:
        path = Path(path).resolve()
        records.remove_leftover_tmp(path)
        entries = records.read_all(path)
        running = next((e for e in entries.values() if e.get("status") == records.RUNNING), None)
        if running is None:
            continue
        job = Serving(name, path, step, running=running, recovered=True)
        work = path / records.WORKDIR
        left = [u for u, e in entries.items() if e.get("status") == records.RUNNING]
        targets = {u: Target(p, name) for u, p in (running.get("engine_paths") or {}).items() if isinstance(p, str)}

        def finalize(job=job, path=path, work=work, left=left, targets=targets) -> dict:
            found = final_entries(running, left, targets, work / OUTPUT)
            ok = all(e["status"] == records.OK for e in found.values())
            record = {"snapshot": job.name, "step": job.step, "status": records.OK if ok else records.FAILED,
                      "engines": found}
            records.write(path, found)
            if work.is_dir() and is_marked(work):
                delete_marked(work)
            return record

        if settle_left(job, work, agent_works, finalize, done=OUTPUT):
            out["adopted"].append(job)
            if hook is not None:
                job.targets = targets
                hook.adopt(job)
        else:
            out["settled"].append(job)
    return out
