"""Durable small writes: fsync a directory, write a JSON file and fsync it, replace one atomically."""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


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


def replace_json_durable(directory: Path, name: str, tmp_prefix: str, obj) -> None:
    """Replace ``directory/name`` by ``obj`` atomically (tmp + fsync + rename + fsync dir): a reader, or a
    crash, sees the old file or the new one, never a part of one. The temporary file is named
    ``tmp_prefix`` and 8 hex digits, so that a later start can prove it is ours (:func:`remove_tmp_files`)."""
    directory = Path(directory)
    tmp = directory / f"{tmp_prefix}{uuid.uuid4().hex[:8]}"
    try:
        write_json_durable(tmp, obj)
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)


def remove_tmp_files(directory: Path, tmp_prefix: str) -> None:
    """The temporaries of :func:`replace_json_durable` a crash left between their write and their rename."""
    try:
        for p in Path(directory).iterdir():
            if p.name.startswith(tmp_prefix) and p.is_file() and not p.is_symlink():
                p.unlink(missing_ok=True)
    except OSError:
        pass
