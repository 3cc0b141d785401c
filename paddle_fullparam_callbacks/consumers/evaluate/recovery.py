"""What earlier jobs' evaluations left, settled when a job starts (or before ``paddle-fullparam evaluate``).

A training job killed while an evaluation ran leaves the snapshot's record saying ``running`` and
its marked work folder; the runner, in a session of its own, usually lives on and finishes. At the
next start (the coordinator holds the output directory's lock) each such snapshot is settled:

- the runner has finished (its ``status.json`` is there): its result is recorded, as it would have
  been by the hook;
- the runner is still running: the new job's hook adopts it (watches it, records it when it ends);
- the runner is gone without a status (killed too): the record says ``unfinished``, and its
  evaluator, if it still runs, is stopped (its process group), provided it is provably the one this
  package started: its environment holds this work folder's ``PFC_OUTPUT``.

Nothing else is touched: only records and work folders this package provably made (the record is
this package's format; the work folder carries the package's marker), and record temporaries
named as this package names them.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from ...export.commit import evaluation as records
from ...export.commit.ownership import is_marked, snapshot_identity
from ..hook import settle_left
from ..runner import EVALUATOR_PID, STATUS
from .hook import OUTPUT, Evaluation, EvaluationHook, finalize, records_json, runner_works


def recover(snapshots: Iterable[Tuple[str, int, Path, bool]], hook: Optional[EvaluationHook] = None
            ) -> Tuple[List[Evaluation], List[Evaluation]]:
    """Settle the evaluations left in ``snapshots`` ((name, step, path, in output_dir) of this
    package's snapshots). Returns (settled now, still running: adopted by ``hook``, or left alone
    when there is none)."""
    settled, alive = [], []
    for name, step, path, in_output_dir in snapshots:
        path = Path(path).resolve()
        records.remove_leftover_tmp(path)
        record = records.read_record(path)
        work = path / records.WORKDIR
        ours = work.is_dir() and not work.is_symlink() and is_marked(work)
        if not records.is_running(record) and not ours:
            continue
        running = record if records.is_running(record) else _running_from_work(name, step, path, work)
        ev = Evaluation(name, path, step, in_output_dir=in_output_dir, running=running, recovered=True)
        if running is None:
            continue  # a finished record and a work folder whose removal was interrupted
        if settle_left(ev, work, runner_works, lambda: _ended(name, path, running, work)):
            if hook is not None:
                hook.adopt(ev)
            alive.append(ev)
        else:
            settled.append(ev)
    return settled, alive


def _ended(name: str, path: Path, running: dict, work: Path) -> dict:
    """The final record of an evaluation whose runner has ended; its evaluator, if the runner died
    without a status and left it running, is stopped first."""
    if not (work / STATUS).exists():
        stop_orphan_evaluator(work)
    return finalize(name, path, running)


def _running_from_work(name: str, step: int, path: Path, work: Path) -> Optional[dict]:
    """A work folder without a running record: the job died between starting the runner and
    recording it (or after the final record, before removing the folder)."""
    from ...export.commit.ownership import delete_marked

    record = records.read_record(path)
    spec = records_json(work / "spec.json")
    if record is not None or spec is None:  # final record already written: only the folder is left
        delete_marked(work)
        return None
    return {"snapshot": name, "step": step, "status": records.RUNNING, "timeout_s": spec.get("timeout_s"),
            "log": records.LOG, "identity": snapshot_identity(path)}


def stop_orphan_evaluator(work: Path) -> bool:
    """An evaluator whose runner died with the job: stop its process group, if its environment proves
    this package started it for ``work`` (``PFC_OUTPUT``). Returns whether one was stopped."""
    info = records_json(work / EVALUATOR_PID) or {}
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"PFC_OUTPUT={work / OUTPUT}".encode() not in environ or os.getpgid(pid) != pid:
            return False
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        return False
    return True
