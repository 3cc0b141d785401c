"""Files placed where their bytes are: which tensors form each shard file, and which rank writes it.

The rule (docs/multi-rank.md, "Placement"):

1. Each destination tensor has **candidate writers**: the mesh positions that hold the most of its
   bytes (a tensor-parallel weight: every rank of its pipeline stage's row, each holding a slice; a
   norm replicated over a row: each of them, whole; an expert: the one rank that holds it).
2. Tensors with the same candidates are packed together, in natural name order, into files of at
   most ``max_shard_size`` (a larger tensor alone), and smaller when that gives each candidate writer
   (in every replica mesh) a file of its own, down to ``split_floor`` (64 MB: a small model keeps its
   one file); files are numbered by their first tensor's name, so the names (``model-0000i-of-0000N``)
   and the index are the ones users know.
3. Each file, largest first, goes to one of its candidates in any replica mesh (data parallel
   replicas hold the same bytes at the same positions), choosing the fewest bytes to fetch from
   another node, then the least loaded writer.
4. While the largest writer holds more than 1.25x the mean, a file moves from it to a less loaded
   rank of the same node when that lowers the maximum (that rank fetches the file's bytes inside the
   node); what still stands above 1.25x is explained in ``note``.

Pure: from the shapes, the holdings of one mesh, the topology and the nodes of the ranks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from .boxes import Holding, HoldingIndex, Need
from .export_plan import ExportPlan, TensorSpec, natural_key, pack, plan_from_groups, units
from .topology import Mesh, TopologyPlan, WritePlan

BALANCE_LIMIT = 1.25
SPLIT_FLOOR = 64 * 2**20  # files are cut below max_shard_size for balance, but not below this
Position = Tuple[int, int]  # (row = pipe index, column = horizontal index) inside a mesh


@dataclass(frozen=True)
class Placement:
    plan: ExportPlan
    writes: WritePlan
    balance: float  # the largest writer's bytes / the mean over all ranks
    note: str  # why ``balance`` is above BALANCE_LIMIT ('' when it is not)


def positions(mesh: Mesh) -> Dict[int, Position]:
    return {r: (v, h) for v, row in enumerate(mesh.rows) for h, r in enumerate(row)}


class _Tensor:
    """One destination: its bytes, and per held piece (bytes, holder positions)."""

    def __init__(self, spec: TensorSpec, pieces: List[Tuple[int, FrozenSet[Position]]], all_positions):
        self.spec = spec
        self.pieces = pieces
        total = sum(n for n, _ in pieces) or 1
        held = {p: sum(n for n, hs in pieces if p in hs) for p in all_positions}
        best = max(held.values()) if held else 0
        self.candidates: FrozenSet[Position] = frozenset(p for p, n in held.items() if n == best)
        self.fraction = best / total


def _tensors(specs, needs, holdings, mesh) -> List[_Tensor]:
    pos = positions(mesh)
    index = HoldingIndex(holdings)
    out = []
    for spec in specs:
        pieces = []
        for need in needs.get(spec.name, ()):
            for piece in index.pieces(need):
                pieces.append((piece.nbytes, frozenset(pos[r] for r in piece.holders if r in pos)))
        out.append(_Tensor(spec, pieces, pos.values()))
    return out


def _lacked(tensors: Sequence[_Tensor], p: Position) -> int:
    return sum(n for t in tensors for n, hs in t.pieces if p not in hs)


def _cross(tensors: Sequence[_Tensor], p: Position, mesh: Mesh, node_of: Mapping[int, object]) -> int:
    """Bytes the writer at ``p`` of ``mesh`` lacks and no holder in its mesh has on its node."""
    here = node_of.get(mesh.rows[p[0]][p[1]])
    n = 0
    for t in tensors:
        for nbytes, hs in t.pieces:
            if p not in hs and not any(node_of.get(mesh.rows[v][h]) == here for v, h in hs):
                n += nbytes
    return n


def _cap(members: Sequence[_Tensor], writers: int, max_shard_size: int, split_floor: int) -> int:
    """The smallest file limit (between the even share and ``max_shard_size``, not below ``split_floor``) at
    which packing in name order makes at most ``writers`` files: files as even as contiguous runs allow."""
    specs = [t.spec for t in members]
    total = sum(s.nbytes for s in specs)
    lo = max([-(-total // writers), split_floor] + [sum(s.nbytes for s in u) for u in units(specs)])
    if lo >= max_shard_size or len(pack(specs, max_shard_size)) > writers:
        return max_shard_size
    hi = max_shard_size
    while lo < hi:
        mid = (lo + hi) // 2
        if len(pack(specs, mid)) <= writers:
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_placement(specs: Sequence[TensorSpec], needs: Mapping[str, Sequence[Need]], holdings: Sequence[Holding],
                   topology: TopologyPlan, holding_mesh: int, max_shard_size: int,
                   node_of: Optional[Mapping[int, object]] = None, *, prefix: str = "model",
                   metadata: "dict | None" = None, split_floor: int = SPLIT_FLOOR) -> Placement:
    """The files and their writers by the module's rule.

    Args:
        specs: the destination tensors (in the snapshot's dtype).
        needs: destination -> the source boxes it reads (``boxes.Need``).
        holdings: what each rank of mesh ``holding_mesh`` holds; the other meshes are its replicas.
        node_of: rank -> node (anything comparable; all ranks on one node when None).
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    node_of = node_of or {}
    meshes = topology.meshes
    # a companion (an FP8 weight's scale) is made by its tensor's writer: it follows the tensor, holds no bytes
    tensors = _tensors([s for s in specs if s.companion_of is None], needs, holdings, meshes[holding_mesh])
    companions: Dict[str, List[_Tensor]] = defaultdict(list)
    for s in specs:
        if s.companion_of is not None:
            companions[s.companion_of].append(_Tensor(s, [], ()))
    by_candidates: Dict[FrozenSet[Position], List[_Tensor]] = defaultdict(list)
    for t in tensors:
        by_candidates[t.candidates].append(t)
        by_candidates[t.candidates].extend(companions.get(t.spec.name, ()))
    groups: List[Tuple[FrozenSet[Position], List[_Tensor]]] = []
    for cands, members in by_candidates.items():
        by_name = {t.spec.name: t for t in members}
        writers = max(1, len(cands) * len(meshes))  # a file per candidate writer, where the bytes allow
        for g in pack([t.spec for t in members], _cap(members, writers, max_shard_size, split_floor)):
            if g:
                groups.append((cands, [by_name[s.name] for s in g]))
    groups.sort(key=lambda cg: natural_key(cg[1][0].spec.name) if cg[1] else ())
    if not groups:
        groups = [(frozenset(), [])]
    plan = plan_from_groups([[t.spec for t in g] for _, g in groups], max_shard_size, prefix=prefix,
                            metadata=metadata)
    sizes = [f.total_bytes for f in plan.files]

    ranks = [r for m in meshes for r in m.ranks]
    load: Dict[int, int] = {r: 0 for r in ranks}
    where: Dict[int, Tuple[Mesh, Position]] = {r: (m, p) for m in meshes for r, p in positions(m).items()}
    writer = [0] * len(groups)
    for i in sorted(range(len(groups)), key=lambda i: (-sizes[i], i)):
        cands, members = groups[i]
        options = [m.rows[v][h] for m in meshes for (v, h) in sorted(cands)] or ranks
        w = min(options, key=lambda r: (_cross(members, where[r][1], where[r][0], node_of), load[r], r))
        writer[i] = w
        load[w] += sizes[i]

    mean = sum(sizes) / max(len(ranks), 1)
    limit = BALANCE_LIMIT * mean
    while True:
        top = max(ranks, key=lambda r: (load[r], -r))
        if load[top] <= limit:
            break
        best = None
        for i in (i for i, w in enumerate(writer) if w == top):
            members = groups[i][1]
            for r in ranks:
                if node_of.get(r) != node_of.get(top) or load[r] + sizes[i] >= load[top]:
                    continue
                m, p = where[r]
                extra = _lacked(members, p) - _lacked(members, where[top][1])
                key = (extra, -(load[top] - max(load[top] - sizes[i], load[r] + sizes[i])), r, i)
                if best is None or key < best[0]:
                    best = (key, i, r)
        if best is None:
            break
        _, i, r = best
        load[top] -= sizes[i]
        load[r] += sizes[i]
        writer[i] = r

    top = max(ranks, key=lambda r: (load[r], -r))
    balance = load[top] / mean if mean else 1.0
    note = ""
    if balance > BALANCE_LIMIT:
        if len(sizes) < len(ranks):
            note = (f"{len(sizes)} file(s) for {len(ranks)} ranks: export.max_shard_size makes files larger than an "
                    f"even share; rank {top} writes {balance:.2f}x the mean")
        else:
            note = (f"rank {top} writes {balance:.2f}x the mean: no file of its can move to a less loaded rank of "
                    f"its node without leaving that rank above it (its files are large, or its node's ranks are busy)")
    mesh_of = {r: m.index for m in meshes for r in m.ranks}
    return Placement(plan, WritePlan(tuple(mesh_of[w] for w in writer), tuple(writer)), balance, note)


__all__ = ["BALANCE_LIMIT", "Placement", "plan_placement", "positions"]
