"""Strict parsing of byte sizes ("5GB", "500MB", "1.5GiB", 1048576)."""
from __future__ import annotations

import re
from decimal import Decimal

_UNITS = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)  # ASCII digits only


def parse_size(value: "str | int", allow_zero: bool = False) -> int:
    """Parse a size in bytes; decimal units (KB, MB, GB) as Hugging Face uses them, binary with "i".
    ``allow_zero``: 0 is a size too (a budget that allows nothing).

    >>> parse_size("5GB"), parse_size("500MB"), parse_size("1KiB"), parse_size(7), parse_size("0", allow_zero=True)
    (5000000000, 500000000, 1024, 7, 0)
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"size must be {'>= 0' if allow_zero else 'positive'}, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(
            f"not a size: {value!r} (write a number with a unit, e.g. '5GB', '500MB', '2GiB')"
        )
    number, unit = m.group(1), (m.group(2) or "B").upper()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {value!r}; use one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    exact = Decimal(number) * _UNITS[unit]  # exact: no float rounding
    if exact != exact.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes ({exact} B); e.g. '2B', '1.5KB', '500MB'")
    size = int(exact)
    if size == 0 and not allow_zero:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


AUTO = "auto"
SYNC_PENDING_DEFAULT = "512MB"  # export.max_pending_bytes auto: a synchronous writer's budget (the disk sets its pace)


def pending_budget(value: "str | int", allow_zero: bool = False) -> int:
    """``export.max_pending_bytes`` as a writer's budget: the size, or SYNC_PENDING_DEFAULT for auto (the
    async staging ring is sized apart, from the rank's bytes: export/session/ring_size.py).

    >>> pending_budget("auto"), pending_budget("2GB")
    (512000000, 2000000000)
    """
    if value == AUTO:
        return parse_size(SYNC_PENDING_DEFAULT)
    try:
        return parse_size(value, allow_zero)
    except ValueError as e:
        raise ValueError(f"{e}; or auto (the async staging ring holds this rank's snapshot bytes, within the "
                         "node's memory)") from None


def format_size(num_bytes: int) -> str:
    """Human-readable size, decimal units.

    >>> format_size(1234567)
    '1.23 MB'
    """
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if num_bytes >= factor:
            return f"{num_bytes / factor:.2f} {unit}"
    return f"{num_bytes} B"
