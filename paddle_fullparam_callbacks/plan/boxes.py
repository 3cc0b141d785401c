"""Boxes of tensors: what ranks hold and what destinations read, as plain data (the routing's inputs).

A *holding* is a box (offset + shape) of a source tensor that one rank holds; a *need* is a box of a
source tensor that one destination reads (one entry of the name mapping: a whole source, a column
block of a fused weight, a tensor-parallel slice). Every rank derives both from the metadata it
already exchanges (the shard records and the destination map), so the plans built on them are the
same everywhere without a word more.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offset, shape)


@dataclass(frozen=True)
class Holding:
    """Rank ``rank`` holds ``key[offset : offset + shape]``, ``itemsize`` bytes an element."""

    rank: int
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class Need:
    """Destination ``dest`` reads ``key[offset : offset + shape]``."""

    dest: str
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]


def intersect(a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int],
              b_shape: Sequence[int]) -> Optional[Box]:
    """The common box of two boxes, or None.

    >>> intersect((0, 0), (4, 4), (2, 3), (4, 4))
    ((2, 3), (2, 1))
    >>> intersect((0,), (2,), (2,), (2,)) is None
    True
    """
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class Piece:
    """The part of a need that lies in one held box: ``holders`` hold all of it (replicas)."""

    dest: str
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    nbytes: int
    holders: Tuple[int, ...]


class HoldingIndex:
    """Holdings grouped by key and box: for each distinct box, the ranks that hold it."""

    def __init__(self, holdings: Iterable[Holding]):
        boxes: Dict[str, Dict[Box, List[int]]] = defaultdict(lambda: defaultdict(list))
        self.itemsize: Dict[str, int] = {}
        for h in holdings:
            boxes[h.key][(tuple(h.offset), tuple(h.shape))].append(h.rank)
            self.itemsize[h.key] = h.itemsize
        self.boxes = {k: sorted((box, tuple(sorted(set(ranks)))) for box, ranks in v.items())
                      for k, v in boxes.items()}

    def pieces(self, need: Need) -> List[Piece]:
        """``need`` cut along the held boxes (distinct boxes of a key do not overlap: validated upstream)."""
        out = []
        for (off, shape), holders in self.boxes.get(need.key, ()):
            common = intersect(off, shape, need.offset, need.shape)
            if common is None:
                continue
            n = elements(common[1]) * self.itemsize[need.key]
            out.append(Piece(need.dest, need.key, common[0], common[1], n, holders))
        return out


__all__ = ["Box", "Holding", "HoldingIndex", "Need", "Piece", "elements", "intersect"]
