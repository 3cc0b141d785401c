"""``verify`` of any path: a snapshot, an output directory, or a ``latest``/``best`` pointer.

A directory holding ``fullparam_manifest.json`` is a snapshot. A directory without one is an
output directory when it holds something only an output directory holds: a pointer file, the
lock (``.fullparam.lock``), a snapshot directory, or a hidden leftover of an export
(``.tmp-*``, ``.trash-*``, ``.replaced-*``, ``.fullparam-*``); any other directory is checked as
a snapshot, and so reported as one without a manifest. In an output directory every snapshot is
verified, and each pointer present must be a regular file naming a snapshot directory there that
verifies; everything else (user files, hidden entries, links) is listed as skipped, not damaged.
A pointer given as a path (``verify out/*`` lists ``out/latest``) is checked the same way.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from ..commit import LOCK, MANIFEST, POINTERS
from ..write.header import short
from .paths import SnapshotDir, Unreadable, describe_path, name_problem
from .snapshot import VerifyReport, check_open_snapshot

POINTER_LIMIT = 4096  # a pointer holds one directory name
_LEFTOVERS = (".tmp-", ".trash-", ".replaced-", ".fullparam-")
Cache = Dict[tuple, VerifyReport]  # (st_dev, st_ino) of a snapshot directory -> its report


@dataclass
class PointerReport:
    path: str
    target: Optional[str] = None
    ok: bool = True
    errors: List[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.errors.append(msg)

    def as_dict(self) -> dict:
        return {"path": self.path, "kind": "pointer", "ok": self.ok, "target": self.target, "errors": self.errors}


@dataclass
class OutputDirReport:
    path: str
    snapshots: List[VerifyReport] = field(default_factory=list)
    pointers: List[PointerReport] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)  # (name, why it is not a snapshot)
    errors: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.snapshots) and all(p.ok for p in self.pointers)

    def as_dict(self) -> dict:
        return {"path": self.path, "kind": "output_dir", "ok": self.ok,
                "snapshots": [r.as_dict() for r in self.snapshots], "pointers": [p.as_dict() for p in self.pointers],
                "skipped": [{"name": n, "reason": why} for n, why in self.skipped], "errors": self.errors}


Report = Union[VerifyReport, OutputDirReport, PointerReport]


def verify_path(path: "str | os.PathLike", check_hashes: bool = True, cache: Optional[Cache] = None) -> Report:
    """Verify a snapshot, an output directory or a pointer file, whichever ``path`` is.

    ``cache`` (shared across calls) keeps a snapshot reached twice, e.g. as a directory and
    through ``latest``, from being checked twice.
    """
    p = Path(path)
    cache = {} if cache is None else cache
    if p.name in POINTERS and os.path.lexists(p) and not p.is_dir():
        return _verify_pointer_path(p, check_hashes, cache)
    report = VerifyReport(str(p))
    problem = describe_path(p)
    if problem:
        report.fail(f"{p}: {problem}")
        return report
    try:
        with SnapshotDir.open(p) as d:
            return _verify_output_dir(d, check_hashes, cache) if _is_output_dir(d) else _snapshot(d, check_hashes, cache)
    except Unreadable as e:  # the directory itself cannot be opened or listed
        report.fail(f"{p}: {e}")
        return report


def _snapshot(d: SnapshotDir, check_hashes: bool, cache: Cache) -> VerifyReport:
    key = d.identity()
    if key not in cache:
        cache[key] = check_open_snapshot(d, VerifyReport(d.path), check_hashes)
    return cache[key]


def _is_output_dir(d: SnapshotDir) -> bool:
    if d.lstat(MANIFEST) is not None:
        return False
    return any(name in POINTERS or name == LOCK or name.startswith(_LEFTOVERS) or _skip_reason(d, name) is None
               for name in d.names())


def _skip_reason(d: SnapshotDir, name: str) -> Optional[str]:
    """Why the entry ``name`` of an output directory is not a snapshot to verify, or None if it is one."""
    if name == LOCK:
        return "the lock of the job writing here"
    if name.startswith(".tmp-"):
        return "the staging directory of an export (in flight, or left by an interrupted one)"
    if name.startswith("."):
        return "a hidden entry (a leftover or temporary file of an export, or the user's)"
    if name in POINTERS:
        return "a pointer"
    try:
        st = d.lstat(name)
        if st is None:
            return "gone (removed while the directory was checked)"
        if stat.S_ISLNK(st.st_mode):
            return "a symbolic link (not followed)"
        if not stat.S_ISDIR(st.st_mode):
            return "a file"
        with d.child(name) as c:
            return None if c.lstat(MANIFEST) is not None else f"a directory without {MANIFEST}"
    except Unreadable as e:
        return f"an entry that {e}"


def _entry(d: SnapshotDir, name: str, check_hashes: bool, cache: Cache) -> "VerifyReport | str":
    """The report of the snapshot ``name`` in ``d``, or why it is not one."""
    why = _skip_reason(d, name)
    if why is not None:
        return why
    try:
        with d.child(name) as c:
            return _snapshot(c, check_hashes, cache)
    except Unreadable as e:
        return f"an entry that {e}"


def _verify_output_dir(d: SnapshotDir, check_hashes: bool, cache: Cache) -> OutputDirReport:
    report = OutputDirReport(d.path)
    names = d.names()
    for name in names:
        if name not in POINTERS:
            got = _entry(d, name, check_hashes, cache)
            if isinstance(got, str):
                report.skipped.append((name, f"{got}: not a snapshot, skipped"))
            else:
                report.snapshots.append(got)
    report.pointers = [_check_pointer(d, p, check_hashes, cache) for p in POINTERS if p in names]
    if not report.snapshots:
        report.errors.append(f"{d.path}: holds no snapshot (no directory with a {MANIFEST})")
    return report


def _verify_pointer_path(p: Path, check_hashes: bool, cache: Cache) -> PointerReport:
    try:
        with SnapshotDir.open(p.parent) as d:
            return _check_pointer(d, p.name, check_hashes, cache)
    except Unreadable as e:
        report = PointerReport(str(p))
        report.fail(f"{p.parent}: {e}")
        return report


def _check_pointer(d: SnapshotDir, pointer: str, check_hashes: bool, cache: Cache) -> PointerReport:
    """``pointer`` must be a regular file holding the name of a snapshot in ``d`` that verifies."""
    report = PointerReport(os.path.join(d.path, pointer))
    try:
        name = d.read_text(pointer, POINTER_LIMIT).strip()
    except Unreadable as e:
        report.fail(f"{pointer}: {e}")
        return report
    report.target = name
    problem = "is empty" if not name else name_problem(name, "the output directory")
    if problem:
        report.fail(f"{pointer}: {problem}")
        return report
    if d.lstat(name) is None:
        report.fail(f"{pointer}: names {short(name)}, which does not exist in {d.path}")
        return report
    found = _entry(d, name, check_hashes, cache)
    if isinstance(found, str):
        report.fail(f"{pointer}: names {short(name)}, which is {found}, not a snapshot")
    elif not found.ok:
        report.fail(f"{pointer}: names {short(name)}, which is DAMAGED (see its report)")
    return report
