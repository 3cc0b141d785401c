"""What in an output directory this package may remove or replace: only what it can prove it made.

- Staging (``.tmp-<name>-<id>``) and trash (``.trash-<name>-<id>``) directories carry a marker
  file, :data:`MARKER`, written when they are made (a directory is marked before it becomes
  trash, and its marker is the last thing deleted); a staging directory drops it just before
  its rename into place, when its manifest already proves it ours.
- Snapshots are directories holding this package's manifest (``fullparam_manifest.json`` with a
  ``manifest_version``).
- Pointer files (``latest``, ``best``) are replaced through temporary files named
  ``.fullparam-tmp-<pointer>-<id>``.
Everything else is the user's: left alone, and logged once if its name looks like ours.
Callers hold the output directory's lock (``lock.py``), so nothing marked belongs to a live job.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import List, Optional, Tuple

from ... import _faults

logger = logging.getLogger("paddle_fullparam_callbacks")

MANIFEST = "fullparam_manifest.json"
MARKER = ".fullparam-owner"
TMP, TRASH, REPLACED = ".tmp-", ".trash-", ".replaced-"
POINTER_TMP = ".fullparam-tmp-"


def mark(directory: Path, run_id: str) -> None:
    """Write the marker that proves this package made ``directory`` (fsynced)."""
    data = json.dumps({"package": "paddle_fullparam_callbacks", "run": run_id, "host": socket.gethostname(),
                       "pid": os.getpid(), "created": time.time()}).encode()
    fd = os.open(directory / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def unmark(directory: Path) -> None:
    (directory / MARKER).unlink(missing_ok=True)


def is_marked(directory: Path) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()).get("package") == "paddle_fullparam_callbacks"
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(directory: Path) -> Optional[dict]:
    """The package manifest of a snapshot directory, or None if it is not one of ours."""
    path = Path(directory) / MANIFEST
    if Path(directory).is_symlink() or not path.is_file() or path.is_symlink():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return manifest if isinstance(manifest, dict) and "manifest_version" in manifest else None


def snapshot_identity(directory: Path) -> Optional[dict]:
    """What tells a snapshot from another one committed later at the same path (its run, sequence and
    creation time), or None if ``directory`` is not one of ours: the consumers of snapshots (evaluation,
    publishing) check it before they act on a path they were handed earlier."""
    m = read_manifest(directory)
    if m is None:
        return None
    run = m.get("run") if isinstance(m.get("run"), dict) else {}
    return {"run": run.get("id"), "seq": run.get("seq"), "created_unix": m.get("created_unix")}


def is_snapshot(directory: Path) -> bool:
    return Path(directory).is_dir() and read_manifest(directory) is not None


def new_staging_dir(output_dir: Path, name: str, run_id: str) -> Path:
    """A marked staging directory. If the marker cannot be written (a full disk fails on its first
    byte), the directory, made a moment ago under a fresh random name, is removed at once: unmarked,
    no later job could prove it ours, and it would stay forever."""
    path = Path(output_dir) / f"{TMP}{name}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        mark(path, run_id)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def delete_marked(path: Path) -> None:
    """Delete a marked directory, its marker last, so that a crash midway leaves a directory the
    next job can still prove is ours."""
    for entry in list(path.iterdir()):
        if entry.name == MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    (path / MARKER).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def remove_snapshot(path: Path, run_id: str) -> None:
    """Delete one of our snapshots so that no half-deleted snapshot is ever visible: mark it,
    rename it to trash, then delete the trash."""
    if not path.exists():
        return
    mark(path, run_id)
    trash = path.parent / f"{TRASH}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    _faults.point("delete")
    delete_marked(trash)


def cleanup_stale(output_dir: Path) -> Tuple[List[str], List[str]]:
    """Leftovers of interrupted exports: (removed, left alone because they are not provably ours).

    A snapshot displaced by an unfinished re-export is put back when its name is free.
    """
    removed, foreign = [], []
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return removed, foreign
    for p in sorted(output_dir.iterdir()):
        name = p.name
        if name.startswith(REPLACED) and p.is_dir() and not p.is_symlink() and read_manifest(p) is not None:
            original = output_dir / re.sub(r"-[0-9a-f]{8}$", "", name[len(REPLACED):])
            if not original.exists() and not original.is_symlink():
                os.rename(p, original)
                unmark(original)
            else:
                mark(p, "cleanup")
                delete_marked(p)
                removed.append(name)
        elif name.startswith((TMP, TRASH, REPLACED)):
            # marked when made; a staging dir about to be committed has dropped its marker but
            # holds the manifest
            if p.is_dir() and not p.is_symlink() and (is_marked(p) or read_manifest(p) is not None):
                delete_marked(p)
                removed.append(name)
            else:
                foreign.append(name)
        elif name.startswith(POINTER_TMP) and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(name)
    if foreign:
        logger.info("left alone in %s (names like this package's leftovers, but not provably its own): %s",
                    output_dir, foreign)
    return removed, foreign
