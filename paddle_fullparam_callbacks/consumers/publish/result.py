"""From what the runner saw to the snapshot's publication record (pure but for reading the runner's files)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..records import log_tail
from ..records import read_json as _json
from . import records

NEXT = "the next start, or `paddle-fullparam publish`, finishes it"


def final_entry(running: dict, status_path: Path, output: Path, log: Path,
                stopped_after_s: Optional[float] = None) -> dict:
    """The final entry of a publication: the running entry, updated by the runner's status (none: the runner
    was killed with the job) and by the publishing process's result (``{output}``, or its last line)."""
    entry = {k: v for k, v in running.items() if k != "status"}
    status = _json(status_path)
    if status is None:
        entry.update(status=records.UNFINISHED, error="the publishing process ended without a result (the job that "
                                                      f"ran it was stopped or killed); {NEXT}")
        return entry
    for key in ("exit_code", "seconds", "finished_unix"):
        if status.get(key) is not None:
            entry[key] = status[key]
    code = status.get("exit_code")
    result = _json(output)
    if result is None and status.get("last_line"):
        try:
            last = json.loads(status["last_line"])
            result = last if isinstance(last, dict) else None
        except ValueError:
            result = None
    if status.get("error"):
        entry.update(status=records.FAILED, error=str(status["error"]))
    elif status.get("terminated"):
        waited = f" (after waiting {stopped_after_s:.0f} s, publish.wait_at_end_s)" if stopped_after_s is not None else ""
        entry.update(status=records.UNFINISHED, error=f"stopped: the training ended before it finished{waited}; {NEXT}")
    elif status.get("timed_out"):
        entry.update(status=records.FAILED, error=f"stopped after publish.timeout_s={running.get('timeout_s')} s")
    elif code != 0:
        how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit status {code}"
        why = (result or {}).get("error") if isinstance((result or {}).get("error"), str) else None
        entry.update(status=records.FAILED, error=why or how)
    else:
        entry.update(status=records.OK, **({"result": result} if result is not None else {}))
    if entry["status"] != records.OK:
        tail = log_tail(log)
        if tail:
            entry["log_tail"] = tail
    return entry
