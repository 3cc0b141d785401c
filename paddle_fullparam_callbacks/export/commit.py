"""The commit protocol: staging directories, the atomic rename, pointers and retention.

A snapshot is a directory ``<output_dir>/<name>`` holding ``fullparam_manifest.json``; its bytes
are written under ``<output_dir>/.tmp-<name>-<id>`` and renamed into place after the manifest,
which is written last. A directory without a manifest is never a snapshot. Pointers
(``latest``, ``best``) are small files replaced atomically. Deletion renames first, so a crash
never leaves a half-deleted directory that still looks like a snapshot.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

from .. import _faults

MANIFEST = "fullparam_manifest.json"
INDEX = "model.safetensors.index.json"
POINTERS = ("latest", "best")
_TMP, _TRASH, _REPLACED = ".tmp-", ".trash-", ".replaced-"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durable(path: Path, obj) -> int:
    """Write JSON, fsync it; return its size."""
    data = (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


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


LOCK = ".fullparam.lock"


class OutputDirLocked(RuntimeError):
    """Another live job exports into the same output_dir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire_lock(output_dir: Path) -> Path:
    """Take ``<output_dir>/.fullparam.lock`` (host, pid) for this process, or fail fast.

    A lock left by a dead process on this host is taken over; a lock of a live process, or of
    another host (whose processes we cannot see), is an error naming its holder. Re-entrant
    within one process. Released by :func:`release_lock` (the session registers it at exit).
    """
    import socket

    path = Path(output_dir) / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
            except (OSError, ValueError):
                holder = {}
            if holder.get("host") == me["host"] and holder.get("pid") == me["pid"]:
                return path
            if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) and not _alive(holder["pid"]):
                path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            if not holder:
                raise OutputDirLocked(f"output_dir {str(output_dir)!r} has an unreadable lock {path}; remove it if no job uses the directory")
            raise OutputDirLocked(
                f"output_dir {str(output_dir)!r} is in use by another job (host {holder.get('host')}, pid "
                f"{holder.get('pid')}, since {holder.get('since', '?')}); give this job its own output_dir, or "
                f"remove {path} if that job is dead"
            )
        with os.fdopen(fd, "w") as f:
            json.dump({**me, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
            f.flush()
            os.fsync(f.fileno())
        return path
    raise OutputDirLocked(f"could not take the lock {path}")


def release_lock(output_dir: Path) -> None:
    path = Path(output_dir) / LOCK
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if holder.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def new_staging_dir(output_dir: Path, name: str) -> Path:
    path = output_dir / f"{_TMP}{name}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def commit_staging(staging: Path, output_dir: Path, name: str) -> Path:
    """Rename a complete staging dir (manifest written last) to ``output_dir/name``."""
    if not (staging / MANIFEST).is_file():
        raise RuntimeError(f"refusing to commit {staging}: it has no {MANIFEST}")
    fsync_dir(staging)
    final = output_dir / name
    displaced = None
    if final.exists():
        # re-export of the same step (e.g. after a resume): swap the two directories in one
        # atomic step, so that `latest`/`best` never point at a missing snapshot
        if _exchange(staging, final):
            _faults.point("replace")
            fsync_dir(output_dir)
            shutil.rmtree(staging, ignore_errors=True)  # the old snapshot, now at the staging name
            return final
        # no renameat2 here: move the old one aside first; cleanup_stale() puts it back if we
        # crash before the new one is in place (a pointer may name a missing directory meanwhile)
        displaced = output_dir / f"{_REPLACED}{name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, displaced)
        _faults.point("replace")
    os.rename(staging, final)
    fsync_dir(output_dir)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
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


def remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted snapshot is ever visible."""
    if not path.exists():
        return
    trash = path.parent / f"{_TRASH}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    _faults.point("delete")
    shutil.rmtree(trash, ignore_errors=True)


def write_pointer(output_dir: Path, pointer: str, name: str) -> None:
    tmp = output_dir / f".{pointer}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _faults.point("pointer")
    os.replace(tmp, output_dir / pointer)
    fsync_dir(output_dir)


def read_pointer(output_dir: Path, pointer: str) -> Optional[str]:
    try:
        name = (Path(output_dir) / pointer).read_text().strip()
    except FileNotFoundError:
        return None
    return name or None


def cleanup_stale(output_dir: Path) -> List[str]:
    """Remove leftovers of interrupted exports; restore a snapshot displaced by an unfinished re-export."""
    removed = []
    if not Path(output_dir).is_dir():
        return removed
    for p in sorted(Path(output_dir).iterdir()):
        if p.name.startswith(_REPLACED) and p.is_dir():
            original = output_dir / re.sub(r"-[0-9a-f]{8}$", "", p.name[len(_REPLACED):])
            if not original.exists() and (p / MANIFEST).is_file():
                os.rename(p, original)
                continue
        if p.name.startswith((_TMP, _TRASH, _REPLACED)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        elif p.name.startswith(".") and any(p.name.startswith(f".{ptr}.") for ptr in POINTERS):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


@dataclass(frozen=True)
class SnapshotEntry:
    name: str
    step: int
    path: Path


def list_snapshots(output_dir: Path, pattern: "re.Pattern[str]") -> List[SnapshotEntry]:
    """Committed snapshots (dirs with a manifest) whose name matches ``pattern``, oldest step first."""
    out = []
    if not Path(output_dir).is_dir():
        return out
    for p in Path(output_dir).iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            out.append(SnapshotEntry(p.name, int(m.group(1)), p))
    out.sort(key=lambda e: (e.step, e.name))
    return out


def snapshot_metric(entry: SnapshotEntry, metric: Optional[str]) -> Optional[float]:
    """The tracked metric recorded in a snapshot's manifest (None if absent)."""
    if not metric:
        return None
    try:
        metrics = json.loads((entry.path / MANIFEST).read_text()).get("metrics") or {}
    except (OSError, ValueError):
        return None
    for key in (metric, f"eval_{metric}"):
        if isinstance(metrics.get(key), (int, float)):
            return float(metrics[key])
    return None


def _candidates(output_dir: Path, pattern, metric: Optional[str]):
    from ..plan.decisions import Candidate

    return [Candidate(e.name, e.step, snapshot_metric(e, metric)) for e in list_snapshots(output_dir, pattern)]


def update_best(output_dir: Path, pattern, metric: Optional[str], mode: str) -> Optional[str]:
    """Point ``best`` at the best committed snapshot by ``metric``; returns its name."""
    from ..plan.decisions import best_of

    if not metric:
        return None
    best = best_of(_candidates(output_dir, pattern, metric), mode)
    if best is not None and read_pointer(output_dir, "best") != best.name:
        write_pointer(output_dir, "best", best.name)
    return best.name if best else None


def apply_retention(output_dir: Path, pattern, keep_last: int, protect: Iterable[str] = (),
                    keep_best: int = 0, metric: Optional[str] = None, mode: str = "min") -> List[str]:
    """Delete snapshots outside the newest ``keep_last`` and the best ``keep_best``; never the
    protected ones (the snapshot being written) or a pointer target (``latest``, ``best``)."""
    from ..plan.decisions import to_remove

    if keep_last <= 0 and keep_best <= 0:
        return []
    protected = set(protect) | {n for n in (read_pointer(output_dir, p) for p in POINTERS) if n}
    doomed = to_remove(_candidates(output_dir, pattern, metric), keep_last, keep_best, mode, protected)
    for name in doomed:
        remove_tree(output_dir / name)
    return doomed
