"""The evaluation record of a snapshot: ``fullparam_evaluation.json``, beside its manifest.

The evaluation hook (``consumers/evaluate/``) scores committed snapshots in separate processes; what
it found is kept in the snapshot's folder, never in the files ``verify`` checks (the manifest's
``files`` table, the shards, the index)::

    hf-step-000010/
      fullparam_manifest.json        # unchanged by an evaluation
      fullparam_evaluation.json      # this record, replaced atomically (tmp + fsync + rename + fsync dir)
      fullparam_eval.log             # the evaluator's stdout and stderr
      .fullparam-eval/               # while it runs: marked work folder ({output}, the runner's status)

A record's ``status`` is ``running`` (with the runner's host and pid: how the next start tells a
live evaluation from an orphan), or final: ``ok`` (with ``scores``), ``failed``, ``timeout``,
``unfinished`` (training ended or was killed first) or ``discarded`` (the evaluator's result is not the snapshot's:
it says why in ``error``, and no score is recorded). Retention reads it here: a snapshot whose
evaluation is running is never removed, and ``retention.metric: evaluate.<key>`` ranks snapshots
by the score ``<key>``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ..write.fsync import remove_tmp_files, replace_json_durable

RECORD = "fullparam_evaluation.json"
LOG = "fullparam_eval.log"
WORKDIR = ".fullparam-eval"
RECORD_TMP = ".fullparam_evaluation.json.tmp-"
RECORD_VERSION = 1
RUNNING, OK, FAILED, TIMEOUT, UNFINISHED = "running", "ok", "failed", "timeout", "unfinished"
DISCARDED = "discarded"  # the evaluator found its result is not the snapshot's (an engine that moved on)
STATUSES = (RUNNING, OK, FAILED, TIMEOUT, UNFINISHED, DISCARDED)
METRIC_PREFIX = "evaluate."  # retention.metric: evaluate.<score>
MAX_RECORD_BYTES = 2_000_000


def read_record(snapshot: "str | Path") -> Optional[dict]:
    """The record of ``snapshot``, or None (none, unreadable, or not this package's)."""
    path = Path(snapshot) / RECORD
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_RECORD_BYTES:
            return None
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("evaluation_version") is None or record.get("status") not in STATUSES:
        return None
    return record


def write_record(snapshot: "str | Path", record: dict) -> None:
    """Replace the record atomically: a reader (or a crash) sees the old record or the new one, never
    a part of one; the temporary file is named so the next start can prove it is ours."""
    replace_json_durable(Path(snapshot), RECORD, RECORD_TMP, {"evaluation_version": RECORD_VERSION, **record})


def scores_of(record: Optional[dict]) -> dict:
    """The numeric scores of a finished evaluation ({} unless ``status`` is ok)."""
    if not record or record.get("status") != OK or not isinstance(record.get("scores"), dict):
        return {}
    return {str(k): float(v) for k, v in record["scores"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def tracked_scores(snapshot: "str | Path") -> dict:
    """``{"evaluate.<key>": value}`` of the snapshot's record, as retention ranks them."""
    return {METRIC_PREFIX + k: v for k, v in scores_of(read_record(snapshot)).items()}


def is_running(record: Optional[dict]) -> bool:
    return bool(record) and record.get("status") == RUNNING


def remove_leftover_tmp(snapshot: "str | Path") -> None:
    """Record temporaries a crash left between their write and their rename (ours by name)."""
    remove_tmp_files(Path(snapshot), RECORD_TMP)
