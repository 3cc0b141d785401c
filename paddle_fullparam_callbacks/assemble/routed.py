"""The routed assembler: each byte a writer lacks crosses once, point to point, from one holder.

It carries out a ``plan.routing.RoutePlan`` and decides nothing: this rank walks the destinations it
writes, in file order, and for each one carries out its own packets of the plan's global order (sends
to other writers and receives for itself) until that destination's last piece has arrived; then the
destination is assembled from its pieces, the ones it held and the ones it received, and yielded. After
the last one, the packets it still has to send. A piece leaves this rank's device only when it is sent
or written (``device.py``'s boundary, within ``export.device_memory_budget``); a received piece is held
until the last destination reading it has been yielded.

The moves run over two-rank gloo groups, one per pair of ranks that exchange bytes (``groups``: made on
first use, in one global order; ``trainer/host_groups.PairGroups`` says why) (``HostGroup.send``/``recv``: gloo's point-to-point, which
Paddle 3.3.1 implements; it has no all-to-all), one packet at a time: a gloo send blocks until its
receiver takes it, and the plan's single global order makes that deadlock-free.

Counts what it does (``stats``): bytes and packets sent and received, and the bytes that crossed nodes.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import _dtypes
from ..host.lazy import LazyArray
from ..host.poison import fresh
from ..plan.boxes import Holding, Need, intersect
from ..plan.routing import Move, Packet, RoutePlan
from .arrays import assemble_destination, cast_for_export, region_of, storage_view
from .device import DeviceBoundary
from .mapping import DestinationMap, MappingError


def holdings_of(records, cast: Optional[Mapping[str, str]] = None) -> List[Holding]:
    """The routing's view of the shard records (``mesh.ShardRecord``); ``cast``: key -> the dtype its holders
    cast it to before it travels (its bytes are counted in that dtype)."""
    cast = cast or {}
    return [Holding(r.rank, r.key, tuple(r.offset), tuple(r.shape), _dtypes.lookup(cast.get(r.key, r.dtype)).itemsize)
            for r in records]


def needs_of(dmap: DestinationMap, names: Iterable[str]) -> Dict[str, List[Need]]:
    """Destination -> the source boxes its mapping entries read."""
    out: Dict[str, List[Need]] = {}
    for name in names:
        out[name] = [Need(name, e.source_slice.key, tuple(e.source_slice.global_offset),
                          tuple(e.source_slice.local_shape)) for e in dmap.entries[name]]
    return out


class RoutedAssembler:
    """Yield ``(name, host array)`` for ``keep`` (this rank's destinations, in file order).

    Args:
        sharded_state_dict: this rank's shards; ``source_dtypes``: source key -> Paddle dtype name (every key
            a move carries).
        plan: the route plan (every rank of the job computes the same one).
        groups: ``get(peer)`` -> the ``HostGroup`` of this rank and ``peer``; ``prepare(pairs)`` makes those
            the plan needs (``trainer/host_groups.PairGroups``).
        node_of: rank -> node, for the cross-node counts.
        transforms: source key -> fn(host array, dtype) -> the array to export (a LoRA merge).
        on_packet: called after each packet (the watchdog's beat).
        early_cast: source keys cast to ``export_dtype`` where they are held, before they travel or are used
            (``local.castable_early``: every destination reading them is the whole source, maybe transposed);
            ``source_dtypes`` gives them as that dtype.
    """

    def __init__(self, sharded_state_dict, dmap: DestinationMap, plan: RoutePlan, keep: Sequence[str], rank: int,
                 groups=None, export_dtype: str = "keep", transforms=None, boundary: Optional[DeviceBoundary] = None,
                 node_of: Optional[Mapping[int, object]] = None, source_dtypes: Mapping[str, str] = (),
                 on_packet=None, early_cast: Iterable[str] = ()):
        self.sd = sharded_state_dict
        self.dmap, self.plan, self.rank, self.groups = dmap, plan, rank, groups
        self.keep = list(keep)
        self.export_dtype = export_dtype
        self.transforms = dict(transforms or {})
        self.boundary = boundary or DeviceBoundary()
        self.node_of = dict(node_of or {})
        self.packets: List[Packet] = plan.packets_of(rank)
        self.moves: Dict[int, Move] = {m.id: m for m in plan.moves if rank in (m.src, m.dst)}
        self.stats = {"sent": 0, "received": 0, "sent_cross_node": 0, "received_cross_node": 0, "packets": 0,
                      "seconds_in_transfers": 0.0}
        self._next = 0  # index into self.packets
        self._missing: Dict[str, int] = Counter(c for m in self.moves.values() if m.dst == rank for c in m.consumers)
        self._arrived: Dict[str, List[int]] = defaultdict(list)  # key -> received move ids
        self._store: Dict[int, np.ndarray] = {}  # move id -> its bytes as an array of its dtype and shape
        self._partial: Dict[int, np.ndarray] = {}  # a large move being received, flat
        self._outgoing: Tuple[int, Optional[np.ndarray]] = (-1, None)  # a large move being sent, flat
        self.source_dtypes = dict(source_dtypes)
        self.early = set(early_cast)
        self.on_packet = on_packet or (lambda: None)
        self.errors: List[str] = []
        self._local: Dict[str, Tuple[object, str]] = {}
        self._uses = Counter()  # local key -> readers left (my destinations and my sends)
        for name in self.keep:
            for key in {e.source_slice.key for e in dmap.entries[name]}:
                if key in self.sd:
                    self._uses[key] += 1
        for m in self.moves.values():
            if m.src == rank:
                self._uses[m.key] += 1

    # ---- this rank's own slices ----------------------------------------------------------------
    def _source(self, key: str):
        held = self._local.get(key)
        if held is None:
            cast = self.export_dtype if key in self.early else None
            arr, dtype = self.boundary.host_array(self.sd[key].local_tensor, cast_to=cast)
            fn = self.transforms.get(key)
            if fn is not None:
                arr = fn(arr, dtype)
            held = self._local[key] = (arr, dtype)
        return held

    def local_bytes(self, key: str) -> np.ndarray:
        """This rank's whole slice of ``key`` as flat host bytes (transformed: a LoRA merge), for the replica
        check (before any packet)."""
        arr, _ = self._source(key)
        out = np.ascontiguousarray(np.asarray(arr)).reshape(-1).view(np.uint8)
        if self._uses[key] <= 0:
            self._local.pop(key, None)
        return out

    def _done_with(self, key: str) -> None:
        self._uses[key] -= 1
        if self._uses[key] <= 0:
            self._local.pop(key, None)

    def _local_box(self, key: str, offset, shape) -> np.ndarray:
        """``key[offset : offset + shape]`` (global coordinates) out of this rank's slice."""
        arr, _ = self._source(key)
        base = tuple(self.sd[key].global_offset)
        rel = tuple(o - b for o, b in zip(offset, base))
        if isinstance(arr, LazyArray) and (any(rel) or tuple(shape) != tuple(arr.shape)):
            arr = arr.materialize()
            self._local[key] = (arr, self._local[key][1])
        return region_of(arr, rel, shape)

    # ---- packets ---------------------------------------------------------------------------------
    def _move_bytes(self, m: Move) -> np.ndarray:
        box = self._local_box(m.key, m.offset, m.shape)
        return np.ascontiguousarray(np.asarray(box)).reshape(-1).view(np.uint8)

    def _send(self, p: Packet) -> None:
        if p.chunk is None:
            buf = np.empty(p.nbytes, np.uint8)
            off = 0
            for i in p.moves:
                m = self.moves[i]
                buf[off:off + m.nbytes] = self._move_bytes(m)
                off += m.nbytes
                self._done_with(m.key)
        else:
            (i,) = p.moves
            m = self.moves[i]
            if self._outgoing[0] != i:
                self._outgoing = (i, self._move_bytes(m))
            buf = self._outgoing[1][p.chunk[0]:p.chunk[1]]
            if p.chunk[1] == m.nbytes:
                self._outgoing = (-1, None)
                self._done_with(m.key)
        self.groups.get(p.dst).send(buf, p.dst)
        self._count(p, "sent")

    def _recv(self, p: Packet) -> List[int]:
        """Returns the ids of the moves completed by this packet."""
        if p.chunk is None:
            buf = fresh(np.empty(p.nbytes, np.uint8))
            self.groups.get(p.src).recv(buf, p.src)
            self._count(p, "received")
            off = 0
            for i in p.moves:  # views of the packet (it lives until its last move is released), a copy if unaligned
                m = self.moves[i]
                piece = buf[off:off + m.nbytes]
                self._keep(m, piece if off % _dtypes.lookup(self._dtype_of(m.key)).itemsize == 0 else piece.copy())
                off += m.nbytes
            return list(p.moves)
        (i,) = p.moves
        m = self.moves[i]
        flat = self._partial.get(i)
        if flat is None:
            flat = self._partial[i] = fresh(np.empty(m.nbytes, np.uint8))
        self.groups.get(p.src).recv(flat[p.chunk[0]:p.chunk[1]], p.src)
        self._count(p, "received")
        if p.chunk[1] < m.nbytes:
            return []
        self._keep(m, self._partial.pop(i))
        return [i]

    def _keep(self, m: Move, flat: np.ndarray) -> None:
        dtype = self._dtype_of(m.key)
        self._store[m.id] = storage_view(flat, dtype, m.shape)
        self._arrived[m.key].append(m.id)

    def _dtype_of(self, key: str) -> str:
        return self.source_dtypes[key]

    def _count(self, p: Packet, what: str) -> None:
        self.stats[what] += p.nbytes
        self.stats["packets"] += 1
        if self.node_of.get(p.src) != self.node_of.get(p.dst):
            self.stats[what + "_cross_node"] += p.nbytes

    def _step(self) -> List[int]:
        p = self.packets[self._next]
        self._next += 1
        t0 = time.perf_counter()
        try:
            if p.src == self.rank:
                self._send(p)
                return []
            return self._recv(p)
        finally:
            self.stats["seconds_in_transfers"] += time.perf_counter() - t0
            self.on_packet()

    # ---- assembly ----------------------------------------------------------------------------------
    def _region(self, desc):
        key, off, shape = desc.key, tuple(desc.global_offset), tuple(desc.local_shape)
        dtype = self._dtype_of(key)
        boxes = []  # (offset, shape, getter)
        if key in self.sd:
            sw = self.sd[key]
            boxes.append((tuple(sw.global_offset), tuple(sw.local_shape), None))
        for i in self._arrived.get(key, ()):
            m = self.moves[i]
            boxes.append((m.offset, m.shape, i))
        for b_off, b_shape, i in boxes:
            if b_off == off and b_shape == shape:  # one box is the whole region: no copy (a lazy merge stays lazy)
                return (self._source(key)[0] if i is None else self._store[i]), dtype
        out = np.empty(shape, dtype=_dtypes.lookup(dtype).np_storage)
        filled = 0
        for b_off, b_shape, i in boxes:
            common = intersect(b_off, b_shape, off, shape)
            if common is None:
                continue
            c_off, c_shape = common
            piece = (self._local_box(key, c_off, c_shape) if i is None
                     else region_of(self._store[i], tuple(a - b for a, b in zip(c_off, b_off)), c_shape))
            out[tuple(slice(a - b, a - b + n) for a, b, n in zip(c_off, off, c_shape))] = np.asarray(piece)
            filled += int(np.prod(c_shape))
        if filled != int(np.prod(shape)):
            raise MappingError(f"parameter {key!r}: the pieces at hand do not cover the region {list(off)}+{list(shape)} "
                               "(the routing plan and the holdings disagree)")
        return out, dtype

    def _release(self, name: str) -> None:
        for key in {e.source_slice.key for e in self.dmap.entries[name]}:
            if key in self.sd:
                self._done_with(key)
            for i in list(self._arrived.get(key, ())):
                m = self.moves[i]
                if name in m.consumers and m.consumers[-1] == name:  # its writer's last reader of it
                    self._store.pop(i, None)
                    self._arrived[key].remove(i)

    def run(self) -> Iterator[Tuple[str, np.ndarray]]:
        if self.packets:
            self.groups.prepare(sorted({(p.src, p.dst) for p in self.plan.packets}))
        for name in self.keep:
            while self._missing.get(name, 0) > 0:
                if self._next >= len(self.packets):
                    raise MappingError(f"destination {name!r}: the routing plan brings none of its missing pieces here")
                for i in self._step():
                    for c in self.moves[i].consumers:
                        self._missing[c] -= 1
            if not self.errors:  # after an error: keep carrying out the packets (the peers wait for them), no more
                try:
                    arr, dtype = assemble_destination(self.dmap.entries[name], self.dmap.spec_by_name[name].dtype,
                                                      self._region)
                    yield name, cast_for_export(arr, dtype, self.export_dtype)
                    arr = None
                except MappingError as e:
                    self.errors.append(str(e))
            self._release(name)
        while self._next < len(self.packets):
            self._step()


__all__ = ["RoutedAssembler", "holdings_of", "needs_of"]
