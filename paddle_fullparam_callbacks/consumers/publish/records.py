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

from pathlib import Path
from typing import Optional

from ..records import KeyedRecord

RECORD = "fullparam_publish.json"
LOG = "fullparam_publish.log"
WORKDIR = ".fullparam-publish"
RUNNING, OK, FAILED, SKIPPED, UNFINISHED = "running", "ok", "failed", "skipped", "unfinished"
STATUSES = (RUNNING, OK, FAILED, SKIPPED, UNFINISHED)
_RECORD = KeyedRecord(RECORD, "publish_version", "destinations", STATUSES)
RECORD_TMP = _RECORD.tmp
read_all, remove_leftover_tmp = _RECORD.read_all, _RECORD.remove_leftover_tmp


def read(snapshot: "str | Path", destination: str) -> Optional[dict]:
    return _RECORD.read(snapshot, destination)


def write(snapshot: "str | Path", destination: str, entry: dict) -> None:
    """Replace ``destination``'s entry atomically (the others are kept)."""
    _RECORD.write(snapshot, {destination: entry})
