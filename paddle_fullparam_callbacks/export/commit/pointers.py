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


def write_pointer(output_dir: Path, pointer: str, name: str) -> None:
    tmp = Path(output_dir) / f"{POINTER_TMP}{pointer}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    _faults.point("pointer")
    os.replace(tmp, Path(output_dir) / pointer)
    fsync_dir(Path(output_dir))


def read_pointer(output_dir: Path, pointer: str) -> Optional[str]:
    try:
        name = (Path(output_dir) / pointer).read_text().strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
        return None
    return name or None
