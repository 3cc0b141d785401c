"""What the processes of a ``paddle-fullparam run`` tree tell ``run``: one small JSON file per Trainer
built, in the directory ``run`` made and named in ``PADDLE_FULLPARAM_RUN_DIR``.

A record says which Trainer class was built where, and what the hook did with it: ``built`` (checked,
waiting for its first event), ``attached`` (a FullParamExportCallback added, with the snapshots'
directory), ``own`` (it had one already) or ``refused`` (with the error that stopped it). ``run`` reads
them when COMMAND has ended (:func:`read_all`, :func:`summary`). Without ``run`` (the variables set by
hand) nothing is written. Records are advisory: a folder that cannot be written loses the summary,
never the training.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
from pathlib import Path
from typing import Iterable, List, Optional

from .startup import RUN_DIR

_SEQ = itertools.count()


class Record:
    """One Trainer's record; :meth:`update` rewrites its file atomically."""

    def __init__(self, trainer: str, framework: str, version: str, environ=None):
        env = os.environ if environ is None else environ
        self.run_dir = env.get(RUN_DIR) or None
        self.data = {
            "trainer": trainer, "framework": framework, "version": version, "state": "built",
            "pid": os.getpid(), "host": socket.gethostname(),
            "rank": int(env.get("PADDLE_TRAINER_ID", env.get("RANK", "0")) or 0),
        }
        self.name = f"trainer-{self.data['host']}-{os.getpid()}-{next(_SEQ)}.json"

    def update(self, state: str, **fields) -> None:
        self.data.update(fields, state=state)
        if self.run_dir is None or not os.path.isdir(self.run_dir):
            return
        path = Path(self.run_dir) / self.name
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, path)
        except OSError:
            pass  # advisory (see the module's docstring)


def read_all(run_dir: "str | os.PathLike") -> List[dict]:
    out = []
    for f in sorted(Path(run_dir).glob("trainer-*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def _ranks(rows: Iterable[dict]) -> str:
    ranks = sorted({r.get("rank", 0) for r in rows})
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def count_snapshots(output_dir: Optional[str]) -> int:
    """Committed snapshots (a directory with a manifest) directly in ``output_dir``."""
    if not output_dir or not os.path.isdir(output_dir):
        return 0
    return sum(1 for d in Path(output_dir).iterdir() if (d / "fullparam_manifest.json").is_file())


def summary(records: List[dict]) -> List[str]:
    """Lines for ``run`` to print: one per (Trainer class, outcome, directory), ranks folded together."""
    groups: dict = {}
    for r in records:
        key = (r.get("trainer"), r.get("framework"), r.get("version"), r.get("state"), r.get("output_dir"),
               r.get("message"), r.get("snapshots"))
        groups.setdefault(key, []).append(r)
    lines = []
    for (trainer, framework, version, state, output_dir, message, _), rows in groups.items():
        who = f"{trainer} ({framework} {version}, {_ranks(rows)})"
        if state == "attached":
            where = rows[0].get("snapshots") or output_dir or "?"
            count = f" ({count_snapshots(output_dir)} committed)" if output_dir else ""
            lines.append(f"{who}: FullParamExportCallback attached; snapshots in {where}{count}")
        elif state == "own":
            lines.append(f"{who}: had its own FullParamExportCallback, kept it (the wrapper added none)")
        elif state == "refused":
            lines.append(f"{who}: refused: {message}")
        else:
            lines.append(f"{who}: built, but it never reached a training event (no callback was needed)")
    return lines
