"""The per-file checksum of a snapshot: BLAKE3 by default, SHA-256 read too.

Every byte of a snapshot is hashed while it is written (``fullparam_manifest.json`` records each
file's digest and ``verify`` checks it). SHA-256 runs at about 1.8 GB/s on one core of these
machines, which made the hash, not the disk, set the pace of an export on a fast disk; BLAKE3
runs at about 4.6 GB/s on one core (``bench/export_single.py`` measures both). The manifest says
which one it used (``checksum``; each file's entry is keyed by the algorithm), and ``verify``
reads snapshots of either. To check a file with standard tools: ``b3sum FILE`` (Debian/Ubuntu
package ``b3sum``, or ``cargo install b3sum``) or ``sha256sum FILE`` for SHA-256 manifests.
"""
from __future__ import annotations

import hashlib
import mmap
import os

try:
    import blake3 as _blake3
except ImportError:  # an install without the dependency still writes and reads SHA-256 snapshots
    _blake3 = None

ALGORITHMS = ("blake3", "sha256")
DEFAULT = "blake3" if _blake3 is not None else "sha256"
DIGEST_HEX = 64  # both give 256-bit digests


def new(algorithm: str = DEFAULT, data: bytes = b""):
    """A hasher with ``update(buffer)`` and ``hexdigest()``. BLAKE3 runs on the calling thread
    (the writer already hashes on a thread of its own, beside the writes)."""
    if algorithm == "blake3":
        if _blake3 is None:
            raise ValueError("this snapshot's checksum is blake3; install it to check it: pip install blake3")
        return _blake3.blake3(data)
    if algorithm == "sha256":
        return hashlib.sha256(data)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def digest_of_stream(f, algorithm: str = DEFAULT, chunk: int = 16 * 2**20) -> str:
    """The digest of what is left to read in the binary file object ``f``."""
    h = new(algorithm)
    while True:
        b = f.read(chunk)
        if not b:
            return h.hexdigest()
        h.update(b)


def digest_of_file(path, algorithm: str = DEFAULT) -> str:
    with open(path, "rb") as f:
        return digest_of_stream(f, algorithm)


def digest_of_mapped(f, algorithm: str = DEFAULT) -> str:
    """:func:`digest_of_stream`'s value for the whole file ``f``, read through a memory map (no copy) and, for
    BLAKE3, hashed on every core (its own threads): for a process that owns its cores while it waits for
    the result (the serving agent, before an engine may reload a snapshot). A file truncated while it is
    mapped kills the process (SIGBUS): never in one that must outlive that (``verify`` reads instead)."""
    size = os.fstat(f.fileno()).st_size
    if algorithm != "blake3" or _blake3 is None or size == 0:
        f.seek(0)
        return digest_of_stream(f, algorithm)
    h = _blake3.blake3(max_threads=_blake3.blake3.AUTO)
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        h.update(m)
    return h.hexdigest()
