"""Poisoned scratch memory: how a test sees a byte that no loop wrote (issue 46).

The byte path reuses memory: per-thread scratch (``casts.scratch``), the copy stage (``copy.py``), the LoRA
product's temporaries, the writer's block pool, the host ring. A chunked loop that skips part of its output
leaves there whatever an earlier tensor left, which can look right: the FP8 memory-order fill once left whole
column runs of a weight unencoded, and nothing noticed until real dimensions (issue 46).

Each of those buffers passes through :func:`fresh` when it is handed out. In production that is one global
read. Inside :func:`poisoned` (tests), every buffer handed out is filled with a byte that changes at each
call, so a byte no one wrote differs from the expected value, and from what the last user left, and shows
as a difference, never as a pass.

>>> import numpy as np
>>> with poisoned(0x40):
...     a, b = fresh(np.zeros(4, np.uint8)), fresh(np.zeros(4, np.uint8))
>>> a.tolist() != [0] * 4 and a.tolist() != b.tolist(), fresh(np.zeros(2, np.uint8)).tolist()
(True, [0, 0])
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Optional

import numpy as np

_seed: Optional[int] = None  # None: production, nothing is filled
_calls = itertools.count()


def fresh(buf: np.ndarray) -> np.ndarray:
    """``buf`` as it is; inside :func:`poisoned`, first filled with this call's pattern byte. Returns ``buf``."""
    if _seed is not None and buf.size:
        # an odd step walks all 256 values before one comes back; 0x00 and 0xFF are as likely as any
        byte = (_seed + 0x3B * next(_calls)) & 0xFF
        if buf.flags.c_contiguous:
            buf.reshape(-1).view(np.uint8).fill(byte)
        else:  # a strided view (the copy stage's padded rows): element by element, each of that byte
            buf[...] = np.full(buf.dtype.itemsize, byte, np.uint8).view(buf.dtype)[0]
    return buf


@contextlib.contextmanager
def poisoned(seed: int = 0xA5) -> Iterator[None]:
    """Within the block, every reusable buffer handed out is filled with a changing pattern (see the module)."""
    global _seed
    before, _seed = _seed, int(seed) & 0xFF
    try:
        yield
    finally:
        _seed = before


__all__ = ["fresh", "poisoned"]
