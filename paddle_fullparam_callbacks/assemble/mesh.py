"""The multi-rank assembler: this project's HV (and single-group) full-parameter assembly.

The reference algorithm is Paddle 3.3.1's ``full_param`` (see DESIGN.md); this implementation
keeps its shape — every rank publishes the slices it holds, replicas are de-duplicated keeping
the lowest rank, slices travel down the vertical (pipe) group and across the horizontal
(tensor-parallel) group — and fixes its defects:

* no device memory: slices come to the host through the device boundary (``device.py``), and
  every buffer, collective and assembly works on host memory over the export's own groups
  (``host_group.py``); a large slice is broadcast in chunks, so a rank that does not keep it
  never holds it whole;
* small slices are **coalesced**: each round, every rank packs its next slices (up to
  ``bucket_bytes``) into one flat byte buffer, and one all-gather per axis moves them all, so
  thousands of norms and biases cost a handful of collective latencies instead of one each;
  a slice larger than the bucket goes alone, as a broadcast;
* planning is computed once from metadata in O(n log n); each round touches only its items;
* a rank keeps only the slices of the tensors it will write and drops the rest on arrival;
  a tensor is assembled as soon as its last slice arrives, and its slices freed;
* a single-group job is the same algorithm on a mesh with one row; a mesh of one rank never
  gets here (see ``LocalAssembler``).

All ranks of a mesh compute the same rounds from the same gathered metadata; an error that is
found while assembling (e.g. two replicas of a slice with different bytes) does not stop the
collectives: it is recorded, and the caller reports it on every rank at the status exchange.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .. import _dtypes
from ..host.poison import fresh
from ..plan.topology import Mesh
from .arrays import assemble_destination, cast_for_export, storage_view
from .device import DeviceBoundary
from .mapping import DestinationMap, MappingError, boxes_intersect

BCAST_CHUNK_BYTES = 64 * 2**20  # a large slice is broadcast in pieces of this size


@dataclass(frozen=True)
class ShardRecord:
    """One slice held by one rank, as published in the metadata exchange."""

    rank: int
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtypes.lookup(self.dtype).itemsize


@dataclass
class ReadItem:
    id: int
    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    dtype: str
    src: int  # the rank that sends it
    holders: Tuple[int, ...]  # every rank holding exactly this slice
    nbytes: int
    consumers: List[str] = field(default_factory=list)  # destination names, in yield order


@dataclass
class Round:
    """One collective step: ``gather`` (each rank sends ``items[rank]``) or ``bcast`` (one item)."""

    kind: str
    items: Dict[int, List[int]]  # rank -> item ids it sends, in buffer order
    width: int = 0  # gather: padded per-rank buffer bytes


def records_from_state_dict(rank: int, sharded_state_dict) -> List[ShardRecord]:
    from .mapping import dtype_name

    names: Dict[object, str] = {}  # one lookup per distinct dtype, not per tensor
    out = []
    for k, sw in sharded_state_dict.items():
        dt = sw.local_tensor.dtype
        name = names.get(dt)
        if name is None:
            name = names[dt] = dtype_name(dt)
        out.append(ShardRecord(rank, k, tuple(sw.global_offset), tuple(sw.local_shape), tuple(sw.global_shape), name))
    return out


def validate_records(records: Sequence[ShardRecord]) -> None:
    """Same global shape and dtype for a key on every rank; every slice inside its tensor; the
    distinct slices of a key tile it exactly (no element missing, no partial overlap)."""
    first: Dict[str, ShardRecord] = {}
    distinct: Dict[str, Dict[tuple, ShardRecord]] = defaultdict(dict)
    for r in records:
        f = first.setdefault(r.key, r)
        if r.global_shape != f.global_shape:
            raise MappingError(
                f"parameter {r.key!r} has global shape {list(f.global_shape)} on rank {f.rank} "
                f"but {list(r.global_shape)} on rank {r.rank}: the ranks do not hold the same model"
            )
        if r.dtype != f.dtype:
            raise MappingError(f"parameter {r.key!r} is {f.dtype} on rank {f.rank} but {r.dtype} on rank {r.rank}")
        if len(r.offset) != len(r.global_shape) or any(o < 0 or o + n > g for o, n, g in zip(r.offset, r.shape, r.global_shape)):
            raise MappingError(
                f"parameter {r.key!r} on rank {r.rank}: slice at {list(r.offset)} of shape {list(r.shape)} "
                f"lies outside its global shape {list(r.global_shape)}"
            )
        distinct[r.key].setdefault((r.offset, r.shape), r)
    for key, slices in distinct.items():
        total = math.prod(first[key].global_shape)
        boxes = list(slices.values())
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if boxes_intersect(a.offset, a.shape, b.offset, b.shape):
                    raise MappingError(
                        f"parameter {key!r}: rank {a.rank} holds {list(a.shape)} at {list(a.offset)} and rank {b.rank} "
                        f"holds {list(b.shape)} at {list(b.offset)}; the slices overlap without being replicas"
                    )
        held = sum(math.prod(b.shape) for b in boxes)
        if held != total:
            raise MappingError(
                f"parameter {key!r}: the ranks of the mesh hold {held} of its {total} elements "
                f"(slices at {sorted(list(b.offset) for b in boxes)}); a shard is missing"
            )


def shard_info_from_records(records: Sequence[ShardRecord]) -> Dict[str, list]:
    """{key: [ShardedWeightDesc]} as AOAEngine wants it (one entry per distinct slice)."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    info: Dict[str, list] = {}
    seen = set()
    for r in sorted(records, key=lambda r: (r.key, r.offset, r.rank)):
        if (r.key, r.offset, r.shape) in seen:
            continue
        seen.add((r.key, r.offset, r.shape))
        info.setdefault(r.key, []).append(ShardedWeightDesc(r.key, r.shape, r.global_shape, r.offset, r.dtype))
    return info


def plan_read_items(records: Sequence[ShardRecord], dmap: DestinationMap, targets: Sequence[str]) -> List[ReadItem]:
    """The slices the mesh must move to assemble ``targets``, ordered by first use.

    Replicas (same key, offset and shape on several ranks) are read once, from the holder that
    sends the fewest bytes so far (ties: the lowest rank), so the gather buffers stay balanced.
    """
    by_key: Dict[str, Dict[tuple, List[ShardRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_key[r.key][(r.offset, r.shape)].append(r)
    items: List[ReadItem] = []
    index: Dict[tuple, ReadItem] = {}
    load: Dict[int, int] = defaultdict(int)  # bytes each rank sends: replicas go to the least loaded holder
    for name in targets:
        for e in dmap.entries[name]:
            src = e.source_slice
            slices = by_key.get(src.key)
            if not slices:
                raise MappingError(f"destination {name!r} needs {src.key!r}, which no rank of the mesh holds")
            for (off, shape), holders in sorted(slices.items()):
                if not boxes_intersect(off, shape, src.global_offset, src.local_shape):
                    continue
                ident = (src.key, off, shape)
                item = index.get(ident)
                if item is None:
                    holders = sorted(holders, key=lambda r: r.rank)
                    h0 = min(holders, key=lambda h: (load[h.rank], h.rank))
                    load[h0.rank] += h0.nbytes
                    item = ReadItem(len(items), src.key, off, shape, h0.dtype, h0.rank,
                                    tuple(h.rank for h in holders), h0.nbytes)
                    index[ident] = item
                    items.append(item)
                if not item.consumers or item.consumers[-1] != name:
                    item.consumers.append(name)
    return items


def plan_rounds(items: Sequence[ReadItem], mesh_ranks: Sequence[int], bucket_bytes: int) -> List[Round]:
    """Group items into collective rounds, keeping first-use order (targets become ready early).

    A gather round holds, per rank, items up to ``bucket_bytes``; an item larger than the bucket
    is a broadcast round of its own.
    """
    rounds: List[Round] = []
    current: Dict[int, List[int]] = {}
    used: Dict[int, int] = defaultdict(int)

    def flush():
        nonlocal current, used
        if current:
            width = max(used.values())
            rounds.append(Round("gather", current, width))
        current, used = {}, defaultdict(int)

    for it in items:
        if it.nbytes > bucket_bytes:
            flush()
            rounds.append(Round("bcast", {it.src: [it.id]}))
            continue
        if used[it.src] + it.nbytes > bucket_bytes:
            flush()
        current.setdefault(it.src, []).append(it.id)
        used[it.src] += it.nbytes
    flush()
    return rounds


class MeshAssembler:
    """Assemble the destinations of one mesh's split; yield only those this rank keeps.

    Args:
        sharded_state_dict: this rank's shards.
        records: the shard records of every rank of the mesh (from the metadata exchange).
        dmap: the destination map built from those records.
        targets: the destinations the mesh assembles, in yield order (file order).
        keep: the destinations this rank needs (the tensors of the files it writes).
        mesh, rank: the mesh and this rank; h_group / v_group: its row and column groups
            (``HostGroup``; v_group None when the mesh has one row, h_group None when it has one column).
        transforms: source key -> fn(this rank's slice as a host array, dtype) -> the slice to send (a
            LoRA merge), made when sent.
        boundary: moves this rank's device slices to the host (``DeviceBoundary``).
    """

    def __init__(self, sharded_state_dict, records, dmap: DestinationMap, targets: Sequence[str], keep: Iterable[str],
                 mesh: Mesh, rank: int, h_group=None, v_group=None, export_dtype: str = "keep",
                 bucket_bytes: int = 64 * 2**20, transforms=None, boundary=None):
        self.sd = sharded_state_dict
        self.boundary = boundary or DeviceBoundary()
        self.transforms = dict(transforms or {})
        self.dmap = dmap
        self.mesh = mesh
        self.rank = rank
        self.h_group, self.v_group = h_group, v_group
        self.export_dtype = export_dtype
        self.targets = list(targets)
        self.keep = set(keep)
        self.items = plan_read_items(records, dmap, self.targets)
        self.rounds = plan_rounds(self.items, mesh.ranks, bucket_bytes)
        self.errors: List[str] = []
        self.collectives = 0
        self.bytes_moved = 0
        # what reached this rank from others (each collective's payload less its own part) and what it gave
        self.stats = {"received": 0, "sent": 0, "packets": 0}
        # what this rank needs: items -> kept consumers, targets -> missing item count
        self._missing: Dict[str, int] = defaultdict(int)
        self._users: Dict[int, List[str]] = {}
        for it in self.items:
            mine = [c for c in it.consumers if c in self.keep]
            if mine:
                self._users[it.id] = mine
                for c in mine:
                    self._missing[c] += 1
        self._store: Dict[int, np.ndarray] = {}
        self._order = {n: k for k, n in enumerate(self.targets)}
        self._pending_uses: Dict[int, int] = {i: len(u) for i, u in self._users.items()}

    def whole_local_bytes(self, key: str) -> np.ndarray:
        """This rank's slice of ``key`` as flat host bytes (transformed: a LoRA merge): what it sends, and what the
        replica check hashes."""
        arr, dtype = self.boundary.host_array(self.sd[key].local_tensor)
        fn = self.transforms.get(key)
        if fn is not None:
            arr = fn(arr, dtype)
        return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    # ---- communication -------------------------------------------------------------------
    def _local_bytes(self, item: ReadItem) -> np.ndarray:
        """This rank's copy of ``item`` as flat host bytes (a CPU slice is shared; a transformed one is new)."""
        return self.whole_local_bytes(item.key)  # an item is always a whole record of this rank

    def _pack(self, ids: List[int], width: int) -> np.ndarray:
        buf = np.zeros(width, dtype=np.uint8)
        off = 0
        for i in ids:
            n = self.items[i].nbytes
            if n:
                buf[off:off + n] = self._local_bytes(self.items[i])
            off += n
        return buf

    def _gather(self, rnd: Round) -> Dict[int, np.ndarray]:
        """One gather round: returns {rank: its flat buffer} for every rank of the mesh."""
        buf = self._pack(rnd.items.get(self.rank, []), rnd.width)
        rows = self.mesh.rows
        # vertical: my column's buffers, in pipe order
        if len(rows) > 1:
            col_buf = self.v_group.all_gather(buf).reshape(-1)
            self.collectives += 1
            self._count(rnd.width * (len(rows) - 1), rnd.width * (len(rows) - 1))  # a ring: each passes on n-1 parts
        else:
            col_buf = buf
        # horizontal: every column's buffer
        if len(rows[0]) > 1:
            row = self.h_group.all_gather(col_buf)
            self.collectives += 1
            self._count(col_buf.nbytes * (len(rows[0]) - 1), col_buf.nbytes * (len(rows[0]) - 1))
        else:
            row = col_buf.reshape(1, -1)
        self.bytes_moved += rnd.width * self.mesh.size
        out = {}
        for hi, cb in enumerate(row):
            for vi in range(len(rows)):
                out[rows[vi][hi]] = cb[vi * rnd.width:(vi + 1) * rnd.width]
        return out

    def _bcast(self, item: ReadItem) -> Optional[np.ndarray]:
        """One large item to every rank of the mesh: down its column, then along each row, in chunks.
        Returns the item's bytes where this rank keeps it (None elsewhere: only a chunk was held)."""
        src = item.src
        keep = item.id in self._users
        dest = fresh(np.empty(item.nbytes, dtype=np.uint8)) if keep else None
        mine = self._local_bytes(item) if self.rank == src else None
        scratch = None
        src_col = self.mesh.v_ranks(src)
        for start in range(0, item.nbytes, BCAST_CHUNK_BYTES):
            n = min(BCAST_CHUNK_BYTES, item.nbytes - start)
            if dest is not None:
                buf = dest[start:start + n]
            else:
                scratch = scratch if scratch is not None else fresh(np.empty(min(BCAST_CHUNK_BYTES, item.nbytes), np.uint8))
                buf = scratch[:n]
            if mine is not None:
                buf[...] = mine[start:start + n]  # a copy: the collective never writes into the model's memory
            if len(self.mesh.rows) > 1 and self.rank in src_col:
                self.v_group.broadcast(buf, src)
                self.collectives += 1
                self._count(0 if self.rank == src else n, n * (len(src_col) - 1) if self.rank == src else 0)
            if len(self.mesh.rows[0]) > 1:
                row = self.mesh.h_ranks(self.rank)
                root = next(r for r in row if r in src_col)
                self.h_group.broadcast(buf, root)
                self.collectives += 1
                self._count(0 if self.rank == root else n, n * (len(row) - 1) if self.rank == root else 0)
        self.bytes_moved += item.nbytes
        return dest

    # ---- assembly --------------------------------------------------------------------------
    def _count(self, received: int, sent: int) -> None:
        self.stats["received"] += received
        self.stats["sent"] += sent
        self.stats["packets"] += 1

    def _accept(self, item: ReadItem, flat: Optional[np.ndarray], copy: bool) -> None:
        """Keep ``item``'s bytes if a destination of this rank needs them (``copy``: out of a round's
        buffer, so the small slices of a round do not keep the whole round's buffer alive)."""
        if item.id not in self._users or flat is None:
            return  # nobody here needs it: dropped on arrival
        flat = flat[: item.nbytes]
        self._store[item.id] = storage_view(flat.copy() if copy else flat, item.dtype, item.shape)

    def _source_slice(self, desc) -> Tuple[np.ndarray, str]:
        """The source region ``desc`` stitched from the stored slices (checking that overlaps agree)."""
        dt = _dtypes.lookup(desc.dtype or "float32")
        for it in self._items_by_key.get(desc.key, ()):
            if it.id in self._store and it.offset == tuple(desc.global_offset) and it.shape == tuple(desc.local_shape):
                return self._store[it.id], dt.name  # one slice is the whole region: no copy
        out = np.empty(desc.local_shape, dtype=dt.np_storage)
        filled = np.zeros(desc.local_shape, dtype=bool)
        for it in self._items_by_key.get(desc.key, ()):
            if it.id not in self._store or not boxes_intersect(it.offset, it.shape, desc.global_offset, desc.local_shape):
                continue
            lo = [max(a, b) for a, b in zip(it.offset, desc.global_offset)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(it.offset, it.shape, desc.global_offset, desc.local_shape)]
            src_ix = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, it.offset))
            dst_ix = tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, desc.global_offset))
            piece = self._store[it.id][src_ix]
            already = filled[dst_ix]
            if already.any() and not np.array_equal(out[dst_ix][already], piece[already]):
                raise MappingError(
                    f"parameter {desc.key!r}: two ranks hold overlapping slices with different values "
                    f"(around offset {lo}); the replicas are out of sync"
                )
            out[dst_ix] = piece
            filled[dst_ix] = True
        if not filled.all():
            raise MappingError(f"parameter {desc.key!r}: the mesh's slices do not cover the region {list(desc.global_offset)}+{list(desc.local_shape)}")
        return out, dt.name

    def _ready(self, item_ids: Iterable[int]) -> List[str]:
        ready = []
        for i in item_ids:
            for c in self._users.get(i, ()):
                self._missing[c] -= 1
                if self._missing[c] == 0:
                    ready.append(c)
        return sorted(set(ready), key=self._order.__getitem__)

    def _release(self, name: str) -> None:
        """Destination ``name`` is done: each source slice it used loses one pending user (once,
        however many of its entries read that slice: a fused q/k/v destination has one per head)."""
        for key in dict.fromkeys(e.source_slice.key for e in self.dmap.entries[name]):
            for it in self._items_by_key.get(key, ()):
                if it.id in self._pending_uses and name in self._users.get(it.id, ()):
                    self._pending_uses[it.id] -= 1
                    if self._pending_uses[it.id] == 0:
                        self._store.pop(it.id, None)
                        del self._pending_uses[it.id]

    def run(self) -> Iterator[Tuple[str, np.ndarray]]:
        self._items_by_key: Dict[str, List[ReadItem]] = defaultdict(list)
        for it in self.items:
            self._items_by_key[it.key].append(it)
        # targets with no source at all (impossible after the coverage check) are not waited for
        for rnd in self.rounds:
            if rnd.kind == "gather":
                bufs = self._gather(rnd)
                arrived = []
                for r, ids in rnd.items.items():
                    off = 0
                    for i in ids:
                        it = self.items[i]
                        self._accept(it, bufs[r][off:off + it.nbytes], copy=True)
                        off += it.nbytes
                        arrived.append(i)
            else:
                (i,) = next(iter(rnd.items.values()))
                self._accept(self.items[i], self._bcast(self.items[i]), copy=False)
                arrived = [i]
            for name in self._ready(arrived):
                if self.errors:
                    self._release(name)
                    continue  # keep taking part in the collectives; the caller reports
                try:
                    arr, dtype = assemble_destination(self.dmap.entries[name], self.dmap.spec_by_name[name].dtype,
                                                      self._source_slice)
                    yield name, cast_for_export(arr, dtype, self.export_dtype)
                except MappingError as e:
                    self.errors.append(str(e))
                self._release(name)
