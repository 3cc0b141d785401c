"""Before an export writes its first byte: is the directory still this job's, and is there room?

One exchange: every rank reports whether its files (the coordinator: the whole snapshot) fit on
its filesystem, and the coordinator whether the output directory and its lock are still the ones
taken at start (``commit.lock``). Any problem is the same :class:`ExportError` on every rank, so
the export is skipped everywhere, through ``on_error``, with nothing written.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Iterable, Optional

from ..commit import room
from ..source import ExportError


def directory_problem(lock, step: int) -> Optional[str]:
    """The coordinator's check of its lock: what changed since the last export (if anything)."""
    if lock is None:
        return None
    lock.verify(f"at the export of step {step}")
    if lock.lost:
        return lock.lost
    events = lock.take_events()
    if events:
        return "; ".join(events) + ". This export is skipped"
    return None


def snapshot_bytes(plan) -> int:
    """The whole snapshot as the coordinator sees it: the shard files and the index (the config,
    tokenizer and manifest are within the margin)."""
    index = len(json.dumps(plan.index(), indent=2)) if plan.needs_index else 0
    return sum(f.total_bytes for f in plan.files) + index


def check(ctx, lock, out_dir: Path, plan, my_files: Iterable[int], step: int, target: str) -> None:
    """Collective: raises the same ExportError on every rank when some rank found a problem."""
    problems = []
    mine = sum(plan.files[i].total_bytes for i in my_files)
    who = f"rank {ctx.rank} ({socket.gethostname()})" if ctx.world_size > 1 else "this export"
    try:
        problems.append(room.shortfall(out_dir, mine, f"the files of {who}"))
        if ctx.is_coordinator:
            problems.append(directory_problem(lock, step))
            problems.append(room.shortfall(out_dir, snapshot_bytes(plan), "the whole snapshot"))
    except OSError as e:
        problems.append(f"{type(e).__name__}: {e}")
    problems = [p for p in problems if p]
    gathered = ctx.all_gather_object(problems[0] if problems else None, what="preflight")
    found = [(r, p) for r, p in enumerate(gathered) if p]
    if found:
        r, p = next(((r, p) for r, p in found if r == ctx.coordinator), found[0])
        where = f" (rank {r})" if ctx.world_size > 1 and r != ctx.coordinator else ""
        raise ExportError(f"export of step {step} to {target} skipped{where}: {p}")
