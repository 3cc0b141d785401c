"""A consumer's record beside a snapshot, keyed by destination: one JSON file holding one entry per
destination of the snapshot (an object store's URL for the publisher, an engine's URL for serving), each
with a ``status`` of the consumer's words. Read defensively (a file that is not the package's reads as
none); replaced atomically (tmp + fsync + rename + fsync dir), each write keeping the other entries."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..export.write.fsync import remove_tmp_files, replace_json_durable

MAX_BYTES = 2_000_000
MAX_RESULT_BYTES = 1_000_000
LOG_TAIL_BYTES = 2000


def read_json(path: Path) -> Optional[dict]:
    """A small JSON object a consumer's process left (its result, its status), or None: missing, too large,
    a link, not JSON, not an object."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_RESULT_BYTES:
            return None
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def log_tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a consumer's log, as text (what a failure's record quotes); "" if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class KeyedRecord:
    """``name`` (the file), ``tag`` (its version key, e.g. ``publish_version``), ``key`` (the map of entries,
    e.g. ``destinations``), the ``statuses`` an entry may have."""

    name: str
    tag: str
    key: str
    statuses: Tuple[str, ...]
    version: int = 1

    @property
    def tmp(self) -> str:
        return f".{self.name}.tmp-"

    def read_all(self, snapshot: "str | Path") -> Dict[str, dict]:
        """{destination: entry} of ``snapshot`` ({} if none, unreadable, or not this package's)."""
        path = Path(snapshot) / self.name
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_BYTES:
                return {}
            obj = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(obj, dict) or obj.get(self.tag) is None or not isinstance(obj.get(self.key), dict):
            return {}
        return {k: v for k, v in obj[self.key].items() if isinstance(v, dict) and v.get("status") in self.statuses}

    def read(self, snapshot: "str | Path", destination: str) -> Optional[dict]:
        return self.read_all(snapshot).get(destination)

    def write(self, snapshot: "str | Path", entries: Dict[str, dict]) -> None:
        """Replace the entries of ``entries``' destinations atomically (the others are kept)."""
        merged = {**self.read_all(snapshot), **entries}
        replace_json_durable(Path(snapshot), self.name, self.tmp, {self.tag: self.version, self.key: merged})

    def remove_leftover_tmp(self, snapshot: "str | Path") -> None:
        remove_tmp_files(Path(snapshot), self.tmp)
