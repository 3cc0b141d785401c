"""What earlier jobs' publications left, settled when a job starts (or before ``paddle-fullparam publish``).

For each snapshot of the output directory, its entry for this destination says:

- ``running``, its runner alive (the job was killed, the publishing process lives on in a session of its
  own): the new job's hook adopts it (watches it, records it when it ends);
- ``running``, its runner gone (killed too): recorded ``unfinished``, and published again;
- ``unfinished`` or ``failed``: published again: the journal beside it resumes each open multipart upload,
  or aborts the ones that no longer fit;
- no entry, in the run this job continues (a resumed job): published (the job may have been killed
  between the commit and the start of its publication), unless a runner is found working on the
  snapshot's folder (killed between starting it and recording it): that one is adopted.

The hook's policy then applies: of the snapshots to publish, the newest and ``best`` win, the others are
recorded as skipped. Uploads under the prefix that no publication here will resume are aborted by the
hook's first job on the store.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ...export.commit.ownership import is_marked
from ..hook import runner_alive, settle_left
from ..runner import find
from . import records
from .hook import Publication, PublishHook, finalize

AGAIN = (records.UNFINISHED, records.FAILED)


def recover(hook: Optional[PublishHook], snapshots: Iterable[Tuple[str, int, Path, Optional[str]]], destination: str,
            run_id: Optional[str] = None) -> Dict[str, List[Publication]]:
    """Settle ``snapshots`` ((name, step, path, run of each)); returns {"settled", "adopted", "todo"}; with a
    hook, the adopted and the todo ones are submitted to it."""
    out: Dict[str, List[Publication]] = {"settled": [], "adopted": [], "todo": []}
    for name, step, path, run in snapshots:
        path = Path(path).resolve()
        records.remove_leftover_tmp(path)
        entry = records.read(path, destination)
        work = path / records.WORKDIR
        if (entry is None or entry.get("status") != records.RUNNING) and work.is_dir() and is_marked(work):
            pid = find(str(work))  # the job died between starting the runner and recording it
            if pid is not None:
                entry = {"snapshot": name, "step": step, "destination": destination, "status": records.RUNNING,
                         "pid": pid, "log": records.LOG}
        pub = Publication(name, path, step, running=entry, recovered=True)
        if entry is not None and entry.get("status") == records.RUNNING:
            if settle_left(pub, work, runner_alive, lambda: finalize(path, destination, entry)):
                out["adopted"].append(pub)
                continue
            out["settled"].append(pub)
            entry = pub.entry
        if (entry is not None and entry.get("status") in AGAIN) or (entry is None and run_id is not None and run == run_id):
            out["todo"].append(Publication(name, path, step, recovered=True))
    if hook is not None:
        if hook.cfg.url:
            keep = [p.name for p in out["adopted"] + out["todo"]]
            hook.submit(Publication("cleanup", hook.output_dir, 0, kind="cleanup", keep=keep))
        for pub in out["adopted"] + out["todo"]:
            hook.submit(pub)
    return out
