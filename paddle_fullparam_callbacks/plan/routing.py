"""The routing plan: each byte a writer lacks, once, from the nearest holder.

Given who writes each destination (``placement.py``), what each rank holds and what each destination
reads (``boxes.py``), the plan lists the **moves**: for every piece of a source that a writer needs and
does not hold, one sender among the piece's holders (a holder on the writer's node first, then the one
that has sent the fewest bytes so far, then the lowest rank). A piece is the part of a held box that
the destination reads, not the whole box: the q block of a fused q/k/v slice moves without k and v.
A piece the writer holds does not move; a piece two destinations of one writer read moves once.

Moves travel as **packets** (one point-to-point send each): the small moves between one sender and one
writer coalesced up to ``bucket_bytes`` in the order the writer uses them, a move larger than
``chunk_bytes`` cut into chunks. Packets are in **one global order** of rounds, each round a matching
of the ranks with each of its pairs giving its next packet each way (so disjoint pairs transfer at the
same time, and every writer's sources advance together through its order of use), and every rank carries
out its own packets in that order: with blocking sends and receives that cannot deadlock (the earliest
packet not yet done always has both its ends waiting for it).

Pure: every rank computes the same plan from the same metadata; nothing is negotiated.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .boxes import Holding, HoldingIndex, Need


@dataclass(frozen=True)
class Move:
    """``key[offset : offset + shape]`` from rank ``src`` to rank ``dst`` (its writer)."""

    id: int
    src: int
    dst: int
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    nbytes: int
    consumers: Tuple[str, ...]  # the writer's destinations that read it, in the writer's order
    cross_node: bool


@dataclass(frozen=True)
class Packet:
    """One send: ``moves`` (ids) packed back to back, or the bytes ``[begin, end)`` of one large move."""

    src: int
    dst: int
    moves: Tuple[int, ...]
    nbytes: int
    chunk: Optional[Tuple[int, int]] = None


@dataclass(frozen=True)
class RankTraffic:
    sent: int = 0
    received: int = 0
    sent_cross_node: int = 0
    received_cross_node: int = 0
    local: int = 0  # bytes of its destinations' sources the rank held itself (nothing moved)

    def as_dict(self) -> dict:
        return {"sent": self.sent, "received": self.received, "sent_cross_node": self.sent_cross_node,
                "received_cross_node": self.received_cross_node, "local": self.local}


@dataclass(frozen=True)
class RoutePlan:
    moves: Tuple[Move, ...]
    packets: Tuple[Packet, ...]
    traffic: Dict[int, RankTraffic]

    def packets_of(self, rank: int) -> List[Packet]:
        """This rank's packets (sent or received), in the global order."""
        return [p for p in self.packets if rank in (p.src, p.dst)]

    def total(self, field: str = "received") -> int:
        return sum(getattr(t, field) for t in self.traffic.values())


def plan_routes(order: Sequence[str], writer_of: Mapping[str, int], needs: Mapping[str, Sequence[Need]],
                holdings: Sequence[Holding], node_of: Optional[Mapping[int, object]] = None,
                bucket_bytes: int = 2 * 2**20, chunk_bytes: int = 64 * 2**20) -> RoutePlan:
    """The moves and packets that bring every destination's sources to its writer.

    Args:
        order: destinations in the order their writers take them (file order).
        writer_of: destination -> the rank that writes it (every holder of its sources is in that
            rank's mesh: ``holdings`` are that mesh's).
        needs: destination -> the source boxes it reads.
        holdings: what each rank holds.
        node_of: rank -> node (all one node when None).
    """
    node_of = node_of or {}
    index = HoldingIndex(holdings)
    moves: Dict[tuple, dict] = {}  # (dst, key, offset, shape) -> move fields, in creation order
    sent: Dict[int, int] = defaultdict(int)
    local: Dict[int, int] = defaultdict(int)
    for dest in order:
        w = writer_of[dest]
        for need in needs.get(dest, ()):
            pieces = index.pieces(need)
            if not pieces and any(need.shape):
                raise ValueError(f"destination {dest!r} reads {need.key!r}, which no rank holds")
            for piece in pieces:
                if w in piece.holders:
                    local[w] += piece.nbytes
                    continue
                ident = (w, piece.key, piece.offset, piece.shape)
                m = moves.get(ident)
                if m is None:
                    near = [h for h in piece.holders if node_of.get(h) == node_of.get(w)] or list(piece.holders)
                    src = min(near, key=lambda h: (sent[h], h))
                    sent[src] += piece.nbytes
                    m = moves[ident] = dict(src=src, dst=w, key=piece.key, offset=piece.offset, shape=piece.shape,
                                            nbytes=piece.nbytes, consumers=[],
                                            cross_node=node_of.get(src) != node_of.get(w))
                if dest not in m["consumers"]:
                    m["consumers"].append(dest)
    out = tuple(Move(i, **{**m, "consumers": tuple(m["consumers"])}) for i, m in enumerate(moves.values()))
    return RoutePlan(out, tuple(_packets(out, bucket_bytes, chunk_bytes)), _traffic(out, local))


def _packets(moves: Sequence[Move], bucket_bytes: int, chunk_bytes: int) -> List[Packet]:
    queues: Dict[Tuple[int, int], List[Packet]] = defaultdict(list)  # (sender, writer) -> its packets, in use order
    open_: Dict[Tuple[int, int], List[Move]] = {}
    filled: Dict[Tuple[int, int], int] = defaultdict(int)

    def flush(pair):
        ms = open_.pop(pair, None)
        filled.pop(pair, None)
        if ms:
            queues[pair].append(Packet(pair[0], pair[1], tuple(m.id for m in ms), sum(m.nbytes for m in ms)))

    for m in moves:  # creation order is the writer's order of use
        pair = (m.src, m.dst)
        if m.nbytes > bucket_bytes:
            flush(pair)
            for b in range(0, m.nbytes, chunk_bytes):
                e = min(b + chunk_bytes, m.nbytes)
                queues[pair].append(Packet(m.src, m.dst, (m.id,), e - b, (b, e)))
            continue
        if filled[pair] + m.nbytes > bucket_bytes:
            flush(pair)
        open_.setdefault(pair, []).append(m)
        filled[pair] += m.nbytes
    for pair in list(open_):
        flush(pair)
    # a packet waits for nothing that a later one brings: within a pair's queue, the writer's order
    for q in queues.values():
        q.sort(key=lambda p: min(p.moves))
    return _in_rounds(queues)


def _in_rounds(queues: Dict[Tuple[int, int], List[Packet]]) -> List[Packet]:
    """The pairs' queues in one global order of rounds: each round a matching of the ranks (the circle
    method: every pair meets once in ``n - 1`` rounds of ``n / 2`` disjoint pairs), each pair of the round
    giving its next packet each way. Consecutive packets of disjoint pairs run at the same time, so a rank
    waits only for its own peer, and each writer's sources advance together through its order of use."""
    ranks = sorted({r for pair in queues for r in pair})
    if len(ranks) % 2:
        ranks.append(None)  # a bye
    n = len(ranks)
    matchings = []
    for k in range(n - 1):
        circle = ranks[:1] + ranks[1:][k:] + ranks[1:][:k]
        matchings.append([(circle[i], circle[n - 1 - i]) for i in range(n // 2)])
    heads = {pair: 0 for pair in queues}
    out: List[Packet] = []
    total = sum(len(q) for q in queues.values())
    while len(out) < total:
        for matching in matchings:
            for a, b in matching:
                for pair in ((a, b), (b, a)):
                    q = queues.get(pair)
                    if q and heads[pair] < len(q):
                        out.append(q[heads[pair]])
                        heads[pair] += 1
    return out


def _traffic(moves: Sequence[Move], local: Mapping[int, int]) -> Dict[int, RankTraffic]:
    acc: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for m in moves:
        acc[m.src]["sent"] += m.nbytes
        acc[m.dst]["received"] += m.nbytes
        if m.cross_node:
            acc[m.src]["sent_cross_node"] += m.nbytes
            acc[m.dst]["received_cross_node"] += m.nbytes
    for r, n in local.items():
        acc[r]["local"] += n
    return {r: RankTraffic(**v) for r, v in sorted(acc.items())}


__all__ = ["Move", "Packet", "RankTraffic", "RoutePlan", "plan_routes"]
