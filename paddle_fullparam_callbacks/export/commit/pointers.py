"""``latest`` and ``best``: small files naming a snapshot, replaced atomically."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Optional

from ... import _faults
from ..write.fsync import fsync_dir
from .ownership import POINTER_TMP

POINTERS = ("latest", "best")


def check_pointers(output_dir: Path) -> None:
    """A pointer path taken by something else than a regular file (a directory, a symlink) would
    make every commit fail halfway: refuse at start, naming it, and touch nothing."""
    for name in POINTERS:
        p = Path(output_dir) / name
        if p.is_symlink() or (p.exists() and not p.is_file()):
            kind = "a symlink" if p.is_symlink() else "a directory" if p.is_dir() else "not a regular file"
            raise FileExistsError(
                f"{str(p)!r} is {kind}; this package keeps its '{name}' pointer there (a file naming a snapshot). "
                "Move it away or use another output_dir"
            )


def prepare_pointer(output_dir: Path, pointer: str, name: str) -> Path:
    """Write the new content of ``pointer`` into a temporary file (fsynced) and return its path: the
    bytes a pointer needs are written before the snapshot it names is renamed into place, so a full
    disk fails the export while nothing of it is visible. Nothing is left if this fails."""
    tmp = Path(output_dir) / f"{POINTER_TMP}{pointer}-{uuid.uuid4().hex[:8]}"
    _faults.point("pointer_tmp")
    try:
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        discard_pointer(tmp)
        raise
    return tmp


def install_pointer(output_dir: Path, pointer: str, tmp: Path) -> None:
    """Replace ``pointer`` by the prepared file atomically (a rename: no new data blocks)."""
    _faults.point("pointer")
    try:
        os.replace(tmp, Path(output_dir) / pointer)
    except BaseException:
        discard_pointer(tmp)
        raise
    fsync_dir(Path(output_dir))


def discard_pointer(tmp: Optional[Path]) -> None:
    if tmp is not None:
        try:
            tmp.unlink()
        except OSError:
            pass


def write_pointer(output_dir: Path, pointer: str, name: str) -> None:
    install_pointer(output_dir, pointer, prepare_pointer(output_dir, pointer, name))


def read_pointer(output_dir: Path, pointer: str) -> Optional[str]:
    try:
        name = (Path(output_dir) / pointer).read_text().strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
        return None
    return name or None
