"""The serve record of a snapshot: ``fullparam_serve.json``, beside its manifest.

It holds one entry per engine (its base URL)::

    hf-step-000010/
      fullparam_manifest.json      # unchanged by serving
      fullparam_serve.json         # {"serve_version": 1, "engines": {"http://10.0.0.5:8000": {...}}}
      fullparam_serve.log          # the swap process's output: a line per engine
      .fullparam-serve/            # while a swap runs: marked work folder (spec, the runner's status, output)

An entry's ``status`` is ``running`` (with the runner's host and pid), or final: ``ok`` (the engine serves
this snapshot, named after it), ``failed`` (``error`` says why, ``version`` what the engine serves now: the
snapshot it served before, reloaded, or ``unknown``), ``skipped`` (newer snapshots won while it waited) or
``unfinished`` (the training ended before its swap started). Each entry keeps the engine's path of the
snapshot, ``version``, the seconds of each call (``pause_s``, ``reload_s``, ``version_s``, ``resume_s``, and
``restore_s`` after a failed reload), ``verify_s``, and ``served_s``: from the commit to the engine serving it.
Adapter mode (``serve.adapter``): ``mode: adapter``, ``adapter`` (the stable name), ``loaded`` and ``unloaded``
(the names of this load), ``adapters`` ({name: the snapshot it serves} the engine holds after it), ``load_s``,
``unload_s``; no pause.
Replaced atomically; only the coordinator (holding the output directory's lock) writes it.
"""
from __future__ import annotations

from ..records import KeyedRecord

RECORD = "fullparam_serve.json"
LOG = "fullparam_serve.log"
WORKDIR = ".fullparam-serve"
RUNNING, OK, FAILED, SKIPPED, UNFINISHED = "running", "ok", "failed", "skipped", "unfinished"
STATUSES = (RUNNING, OK, FAILED, SKIPPED, UNFINISHED)
_RECORD = KeyedRecord(RECORD, "serve_version", "engines", STATUSES)
read_all, read, write, remove_leftover_tmp = _RECORD.read_all, _RECORD.read, _RECORD.write, _RECORD.remove_leftover_tmp
