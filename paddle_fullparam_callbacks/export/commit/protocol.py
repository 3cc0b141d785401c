"""The commit protocol: the output directory, the atomic rename of a staging directory.

A snapshot is a directory ``<output_dir>/<name>`` holding ``fullparam_manifest.json``; its bytes
are written under ``<output_dir>/.tmp-<name>-<id>`` (marked as this package's, ``ownership.py``)
and renamed into place after the manifest, which is written last. A directory without a manifest
is never a snapshot. The package's ``__init__`` is the export layer's one door to the commit
protocol: it re-exports this module, the lock (``lock.py``), ownership and leftovers
(``ownership.py``) and pointers (``pointers.py``).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from ... import _faults
from ..write.fsync import fsync_dir
from .ownership import MANIFEST, REPLACED, delete_marked, is_snapshot, mark, unmark

INDEX = "model.safetensors.index.json"


def check_output_dir(output_dir: Path) -> None:
    """Create output_dir if needed and prove it is writable, before any snapshot byte is written."""
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output_dir {str(output_dir)!r} is not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"output_dir {str(output_dir)!r} cannot be created: {e.strerror or e}") from e
    probe = output_dir / f".write-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"output_dir {str(output_dir)!r} is not writable: {e.strerror or e}") from e


def commit_staging(staging: Path, output_dir: Path, name: str) -> Path:
    """Rename a complete staging dir (manifest written last) to ``output_dir/name``."""
    if not (staging / MANIFEST).is_file():
        raise RuntimeError(f"refusing to commit {staging}: it has no {MANIFEST}")
    fsync_dir(staging)
    final = output_dir / name
    displaced = None
    if final.exists() or final.is_symlink():
        if not is_snapshot(final) or final.is_symlink():
            raise FileExistsError(f"{str(final)!r} exists and is not a snapshot of this package; refusing to replace it")
        mark(final, "replaced")  # becomes the staging (or displaced) name: provably ours if we crash
        # re-export of the same step (e.g. after a resume): swap the two directories in one
        # atomic step, so that `latest`/`best` never point at a missing snapshot
        unmark(staging)
        if _exchange(staging, final):
            _faults.point("replace")
            fsync_dir(output_dir)
            delete_marked(staging)  # the old snapshot, now at the (marked) staging name
            return final
        # no renameat2 here: move the old one aside first; cleanup_stale() puts it back if we
        # crash before the new one is in place (a pointer may name a missing directory meanwhile)
        displaced = output_dir / f"{REPLACED}{name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, displaced)
        _faults.point("replace")
    unmark(staging)  # from here its manifest proves it ours; the snapshot carries no marker
    os.rename(staging, final)
    fsync_dir(output_dir)
    if displaced is not None:
        delete_marked(displaced)
    return final


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL / ENOSYS / EOPNOTSUPP: the filesystem or kernel cannot
        return False
    raise OSError(err, os.strerror(err), str(b))
