"""Every rank sees the same output directory: proven at start, before the first training step.

Each rank writes its own shard files into the staging directory the coordinator made, so a job
whose ranks see different directories at one path (node-local NVMe, a relative path resolved in
different working directories, a mount missing on one node) would train to the end and commit
nothing. At start the coordinator writes a token file into the directory; every rank reads it
back through its own view of the path and creates and removes a file of its own there; the
results are exchanged, and any failure is the same :class:`~...config.schema.ConfigError` on every
rank, naming the directory and the ranks and hosts that cannot use it.

Cost: one small file written and read, one file created and removed per rank, one exchange
(the token travels in the session's start exchange).
"""
from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..write.fsync import fsync_dir

PROBE = ".fullparam-visible-"
_READ_TRIES = 3  # a token not found at once is looked for again (attribute caches of network filesystems)
_READ_PAUSE_S = 0.5


def write_token(directory: Path) -> str:
    """The coordinator's half: a token file in ``directory`` (which exists), durable. Returns the token."""
    token = uuid.uuid4().hex
    path = Path(directory) / f"{PROBE}{token}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(Path(directory))
    return token


def remove_token(directory: Path, token: str) -> None:
    try:
        (Path(directory) / f"{PROBE}{token}").unlink()
    except OSError:
        pass


def check_visible(directory: Path, token: str, rank: int) -> Optional[str]:
    """Every rank's half: None when this rank reads the coordinator's token in ``directory`` and can
    create and remove a file there, else what it saw instead."""
    directory = Path(directory)
    path = directory / f"{PROBE}{token}"
    seen = None
    for attempt in range(_READ_TRIES):
        try:
            with open(path, "rb") as f:
                seen = f.read(64).decode(errors="replace")
            break
        except FileNotFoundError:
            if attempt + 1 < _READ_TRIES:
                time.sleep(_READ_PAUSE_S)
        except OSError as e:
            return f"cannot read it ({e.strerror or e})"
    if seen is None:
        if not directory.is_dir():
            return "the directory does not exist here"
        return "the directory exists here but is another one (the coordinator's token file is not in it)"
    if seen != token:
        return f"the token file holds {seen!r}, not the coordinator's token"
    own = directory / f"{PROBE}{token}-rank{rank}"
    try:
        fd = os.open(own, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        own.unlink()
    except OSError as e:
        kind = "no space left" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
        return f"cannot create and remove a file in it ({kind})"
    return None


def probe(directory: Path, token: str, rank: int) -> Tuple[int, str, Optional[str]]:
    """(rank, host, problem or None): what a rank contributes to the exchange."""
    return rank, socket.gethostname(), check_visible(directory, token, rank)


def unshared_message(directory: Path, results: Sequence[Tuple[int, str, Optional[str]]], what: str) -> Optional[str]:
    """The error every rank raises when some rank cannot use ``directory`` (None if all can).

    ``results``: (rank, host, problem) of every rank; ``what`` goes before the path."""
    bad: List[Tuple[int, str, str]] = [(r, h, p) for r, h, p in results if p]
    if not bad:
        return None
    hosts = sorted({h for _, h, _ in bad})
    lines = "; ".join(f"rank {r} on {h}: {p}" for r, h, p in bad[:8])
    more = f" (and {len(bad) - 8} more ranks)" if len(bad) > 8 else ""
    return (f"{what}{str(directory)!r} is not the same directory on every rank: {len(bad)} of {len(results)} ranks "
            f"(hosts {', '.join(hosts)}) cannot use the coordinator's: {lines}{more}. Every rank writes its own files "
            "of each snapshot there, so the job would train without committing any. Use a path on a filesystem every "
            "node mounts at the same place (NFS, Lustre/CPFS, ...), given as an absolute path")
