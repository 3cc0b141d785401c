"""Room for a snapshot, checked on every rank before an export writes anything.

A rank's need is the bytes of the files it writes plus a margin (``MARGIN_FRACTION`` of them, at
least ``MARGIN_MIN``: the side files, metadata blocks). The coordinator also checks the whole
snapshot against its view of the filesystem, which every rank shares (proven at start). Free
space is what an unprivileged writer may use (``f_bavail``): root's reserved blocks do not count.
Quotas (EDQUOT) are not visible here; a write that hits one fails like a full disk.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ...config.sizes import format_size

MARGIN_FRACTION = 0.01
MARGIN_MIN = 1 << 20


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of ``directory`` (or of its
    nearest existing parent, for a directory not made yet)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def with_margin(nbytes: int) -> int:
    return nbytes + max(MARGIN_MIN, int(nbytes * MARGIN_FRACTION))


def shortfall(directory: Path, nbytes: int, who: str) -> Optional[str]:
    """None when ``nbytes`` (plus the margin) fit on the filesystem of ``directory``, else why not."""
    if nbytes <= 0:
        return None
    need, free = with_margin(nbytes), free_bytes(directory)
    if need <= free:
        return None
    return (f"not enough free space in {str(directory)!r} for {who}: {format_size(nbytes)} ({nbytes} bytes) to write "
            f"plus a margin of {format_size(need - nbytes)}, and its filesystem has {format_size(free)} ({free} bytes) "
            "free; nothing was written. Free space there, lower retention.keep_last, or use another output_dir")
