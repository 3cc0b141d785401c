"""Durable small writes: fsync a directory, write a JSON file and fsync it."""
from __future__ import annotations

import json
import os
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
