"""The commit protocol: staging, the atomic rename, pointers, retention, the manifest, ownership,
the lock and the watchdog.

This package's namespace is the export layer's one door to it (``from ..commit import ...`` or
``commit.check_output_dir(...)``): the protocol itself (``protocol.py``), ownership and leftovers
(``ownership.py``), the lock (``lock.py``) and the pointers (``pointers.py``).
"""
from ..write.fsync import fsync_dir, write_json_durable
from .lock import LOCK, OutputDirLocked, acquire_lock
from .ownership import (
    MANIFEST,
    REPLACED,
    cleanup_stale,
    delete_marked,
    is_snapshot,
    mark,
    new_staging_dir,
    remove_snapshot,
    unmark,
)
from .pointers import (
    POINTERS,
    check_pointers,
    discard_pointer,
    install_pointer,
    prepare_pointer,
    read_pointer,
    write_pointer,
)
from .protocol import INDEX, check_output_dir, commit_staging

__all__ = [
    "INDEX", "LOCK", "MANIFEST", "POINTERS", "REPLACED", "OutputDirLocked", "acquire_lock", "check_output_dir",
    "check_pointers", "cleanup_stale", "commit_staging", "delete_marked", "discard_pointer", "fsync_dir",
    "install_pointer", "is_snapshot", "mark", "new_staging_dir", "prepare_pointer", "read_pointer", "remove_snapshot",
    "unmark", "write_json_durable", "write_pointer",
]
