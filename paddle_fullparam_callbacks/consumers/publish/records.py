"""The publication record of a snapshot: ``fullparam_publish.json``, beside its manifest.

It holds one entry per destination (the ``publish.url``, or ``command``)::

    hf-step-000010/
      fullparam_manifest.json      # unchanged by a publication
      fullparam_publish.json       # {"publish_version": 1, "destinations": {"s3://bkt/run": {...}}}
      fullparam_publish.log        # the publishing process's output
      .fullparam-publish/          # while it runs, or after an interrupted one: marked work folder
                                   # (spec, the runner's status, the multipart journal)

An entry's ``status`` is ``running`` (with the runner's host and pid), or final: ``ok``, ``failed``,
``skipped`` (newer snapshots won while it waited), or ``unfinished`` (training ended or the job was
killed first: the next start, or ``paddle-fullparam publish``, finishes it). Replaced atomically, like the
evaluation record; only the coordinator (holding the output directory's lock) writes it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ...export.write.fsync import remove_tmp_files, replace_json_durable

RECORD = "fullparam_publish.json"
LOG = "fullparam_publish.log"
WORKDIR = ".fullparam-publish"
RECORD_TMP = ".fullparam_publish.json.tmp-"
VERSION = 1
RUNNING, OK, FAILED, SKIPPED, UNFINISHED = "running", "ok", "failed", "skipped", "unfinished"
STATUSES = (RUNNING, OK, FAILED, SKIPPED, UNFINISHED)
MAX_BYTES = 2_000_000


def read_all(snapshot: "str | Path") -> dict:
    """{destination: entry} of ``snapshot`` ({} if none, unreadable, or not this package's)."""
    path = Path(snapshot) / RECORD
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_BYTES:
            return {}
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(obj, dict) or obj.get("publish_version") is None or not isinstance(obj.get("destinations"), dict):
        return {}
    return {k: v for k, v in obj["destinations"].items() if isinstance(v, dict) and v.get("status") in STATUSES}


def read(snapshot: "str | Path", destination: str) -> Optional[dict]:
    return read_all(snapshot).get(destination)


def write(snapshot: "str | Path", destination: str, entry: dict) -> None:
    """Replace ``destination``'s entry atomically (the others are kept)."""
    destinations = {**read_all(snapshot), destination: entry}
    replace_json_durable(Path(snapshot), RECORD, RECORD_TMP, {"publish_version": VERSION, "destinations": destinations})


def remove_leftover_tmp(snapshot: "str | Path") -> None:
    remove_tmp_files(Path(snapshot), RECORD_TMP)
