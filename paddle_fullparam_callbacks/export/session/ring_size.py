"""How large the async staging ring is: the sizing rule, pure (the session reads the inputs).

With ``export.async_write`` training resumes once every tensor of the rank is copied into the
staging ring (host/HostRing); bytes that do not fit wait for the disk on the training thread. So
by default (``export.max_pending_bytes: auto``) the ring holds all of this rank's snapshot bytes,
and only the node's memory limits it: half of what the kernel reports available
(``MemAvailable``), shared equally among the job's ranks on the node (``PADDLE_LOCAL_SIZE``). The
other half stays for whatever else the job allocates later. An explicit size still wins over the rule.

When the model fills the host (issue 47) the rule must not take memory the training is about to
need: the ring is built after the first training step (the callback's first ``on_step_end``), not at
``on_train_begin``, because Paddle's optimizers create their states (moments, master weights) at the
first step; and at every export MemAvailable is read again, and where the node has become short of
memory beside the ring (the job grew since) the ring is made again, smaller, by the same rule, before
anything is copied (``short_of_memory``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ...config.sizes import format_size
from ...host.pool import local_ranks

AVAILABLE_SHARE = 2  # the ring may take 1/AVAILABLE_SHARE of the node's available memory, split among its ranks
UNKNOWN_CAP = 512 * 10**6  # no MemAvailable (not Linux): the ring that the old default allowed
SHORT_BELOW = 2  # an auto ring is made again, smaller, once MemAvailable is below the node's rings / SHORT_BELOW


@dataclass(frozen=True)
class RingSize:
    """The ring's bytes and the figures they come from (for the message)."""

    bytes: int
    wanted: int  # this rank's snapshot bytes: what the ring would hold uncapped
    cap: Optional[int] = None  # auto: the node's share for this rank; None for an explicit size
    available: Optional[int] = None  # MemAvailable, when known
    ranks: int = 1  # the job's ranks on this node

    @property
    def capped(self) -> bool:
        """auto, and the node's memory (not the rank's bytes) set the size."""
        return self.cap is not None and self.bytes < self.wanted


def mem_available(meminfo: Optional[str]) -> Optional[int]:
    """``MemAvailable`` in bytes from the text of /proc/meminfo (None when absent or unreadable).

    >>> mem_available("MemTotal:  16 kB\\nMemAvailable:     2048 kB\\n")
    2097152
    """
    for line in (meminfo or "").splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable":
            fields = rest.split()
            try:
                kib = int(fields[0])
            except (IndexError, ValueError):
                return None
            return kib * 1024 if kib >= 0 else None
    return None


def read_meminfo(path: str = "/proc/meminfo") -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def ring_size(rank_bytes: int, setting: Optional[int], meminfo: Optional[str],
              environ: Mapping[str, str]) -> RingSize:
    """The ring for a rank whose files hold ``rank_bytes``.

    ``setting``: an explicit ``export.max_pending_bytes`` (min(setting, rank_bytes)), or None for
    auto: min(rank_bytes, MemAvailable // AVAILABLE_SHARE // ranks on the node); UNKNOWN_CAP
    stands for that cap where MemAvailable is unknown. Never below 1 byte (a rank that writes no
    file keeps an empty ring).

    >>> ring_size(10**9, None, "MemAvailable: 8000000 kB", {"PADDLE_LOCAL_SIZE": "8"}).bytes
    512000000
    >>> ring_size(10**9, 2 * 10**9, None, {}).bytes
    1000000000
    """
    wanted = max(0, int(rank_bytes))
    if setting is not None:
        return RingSize(max(1, min(int(setting), wanted)), wanted)
    available = mem_available(meminfo)
    ranks = local_ranks(environ)
    cap = UNKNOWN_CAP if available is None else max(1, available // AVAILABLE_SHARE // ranks)
    return RingSize(max(1, min(wanted, cap)), wanted, cap, available, ranks)


def short_of_memory(ring_bytes: int, meminfo: Optional[str], environ: Mapping[str, str]) -> bool:
    """Whether the node has become short of memory beside an auto ring of ``ring_bytes``: MemAvailable below
    half of what the node's rings hold (this one's times its ranks). The rule leaves at least as much as the
    rings take when they are made; half of that gone means the job grew since. (A criterion on this ring's own
    share would fire for the node's first ranks, whose rings are made before the others' take memory.) False
    when MemAvailable is unknown.

    >>> short_of_memory(4 * 10**9, "MemAvailable: 3000000 kB", {})  # 3.07 GB free beside a 4 GB ring
    False
    >>> short_of_memory(4 * 10**9, "MemAvailable: 1900000 kB", {})  # 1.95 GB: under half
    True
    """
    available = mem_available(meminfo)
    if available is None:
        return False
    return available < ring_bytes * local_ranks(environ) // SHORT_BELOW


def shrunk_message(old: int, new: int, available: Optional[int], rank: int) -> str:
    """The one line said when a ring is rebuilt smaller at an export."""
    return (f"rank {rank}: the node's available host memory fell to {format_size(available or 0)} since the async "
            f"staging ring was made: the ring goes from {format_size(old)} to {format_size(new)} (half of what is "
            f"available, so that it never pushes the node out of memory); set export.max_pending_bytes to fix its size")


def capped_message(r: RingSize, rank: int) -> str:
    """The one line said at start when the node's memory limits an auto ring."""
    if r.available is None:
        whence = f"{format_size(r.cap)} (the node's available memory is unknown: no MemAvailable in /proc/meminfo)"
    else:
        whence = (f"{format_size(r.cap)}: half the node's {format_size(r.available)} of available host memory "
                  f"shared among its {r.ranks} rank(s) (PADDLE_LOCAL_SIZE)")
    return (f"rank {rank}: the async staging ring holds {format_size(r.bytes)} of this rank's "
            f"{format_size(r.wanted)} snapshot bytes, capped at {whence}; during each export training waits "
            f"for the disk to take the other {format_size(r.wanted - r.bytes)}. Set export.max_pending_bytes "
            f"(e.g. '{_round_up_gb(r.wanted)}') to choose the ring's size yourself")


def _round_up_gb(n: int) -> str:
    return f"{max(1, -(-n // 10**9))}GB"
