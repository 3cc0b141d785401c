"""The publisher's journal: which multipart uploads it started, for which file and destination.

One JSON object per line, appended and fsynced before the upload it names receives its first part
(``upload``), and when that upload is completed or aborted (``done``). After a crash, the next
publication of the snapshot reads it back: each upload still open is resumed (its parts are listed by
the store, and each part whose ETag matches the local bytes is kept) or, if it no longer fits the
file (another part size, another file), aborted. Uploads the journal never learnt of (a crash between
the store's answer and the journal's write) are found by listing the snapshot's prefix on the store.
A line cut short by a crash is ignored: it named no upload that received a part.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Dict, Optional


class Journal:
    """The journal file ``path`` (created on first write)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def _append(self, entry: dict) -> None:
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    def started(self, url: str, key: str, upload_id: str, part_size: int, size: int, digest: str) -> None:
        self._append({"event": "upload", "url": url, "key": key, "upload_id": upload_id, "part_size": part_size,
                      "size": size, "digest": digest})

    def done(self, url: str, key: str, upload_id: str) -> None:
        self._append({"event": "done", "url": url, "key": key, "upload_id": upload_id})

    def open_uploads(self, url: Optional[str] = None) -> Dict[str, dict]:
        """Uploads started and neither completed nor aborted: {upload id: its ``upload`` entry} (of ``url``)."""
        out: Dict[str, dict] = {}
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line a crash cut short
            if not isinstance(entry, dict) or (url is not None and entry.get("url") != url):
                continue
            if entry.get("event") == "upload" and isinstance(entry.get("upload_id"), str):
                out[entry["upload_id"]] = entry
            elif entry.get("event") == "done":
                out.pop(entry.get("upload_id"), None)
        return out

    def clear(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
