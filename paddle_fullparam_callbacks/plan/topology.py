"""The topology plan: which ranks form each assembly mesh, and who writes which file.

Pure: from the hybrid topology (axis names and degrees in Paddle's ``CommunicateTopology``
order, the sharding stage) every rank computes the same plan without communicating.

Policy (DESIGN.md, "Topology policy"):

* a **mesh** is one model replica's model-parallel ranks: its rows are the *horizontal* groups
  (tensor parallel ``model``, with ``expert`` and, at sharding stage 3, ``sharding`` joining
  them), its columns the *vertical* groups (``pipe``);
* the replica axes (``data``, ``sharding`` at stage 1/2, ``sep``, ``context``) give
  independent meshes holding the same parameters: the export work is split across them;
* with no model-parallel axis every rank is a mesh of one and assembles without communication.

Rank numbering follows Paddle: the cartesian product of the axes in the given order, the last
axis varying fastest.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

AXIS_ALIASES = {
    "data": "data", "dp": "data",
    "pipe": "pipe", "pp": "pipe",
    "sharding": "sharding",
    "sep": "sep",
    "context": "context", "cp": "context",
    "model": "model", "mp": "model",
    "expert": "expert", "ep": "expert",
}
# Paddle's default order of hybrid axes (CommunicateTopology): data, pipe, sharding, sep, model
DEFAULT_ORDER = ("data", "pipe", "sharding", "sep", "model")


@dataclass(frozen=True)
class Mesh:
    """One replica's ranks: ``rows[v][h]`` is the rank at pipe index v, horizontal index h."""

    index: int
    rows: Tuple[Tuple[int, ...], ...]

    @property
    def ranks(self) -> Tuple[int, ...]:
        return tuple(r for row in self.rows for r in row)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def ranks_in_gather_order(self) -> Tuple[int, ...]:
        """Ranks in the order a row-then-column gather lists them: rows (pipe) outer, columns inner."""
        return self.ranks

    def h_ranks(self, rank: int) -> Tuple[int, ...]:
        """The horizontal group of ``rank`` (its row)."""
        for row in self.rows:
            if rank in row:
                return row
        raise KeyError(rank)

    def v_ranks(self, rank: int) -> Tuple[int, ...]:
        """The vertical group of ``rank`` (its column)."""
        h = self.h_ranks(rank).index(rank)
        return tuple(row[h] for row in self.rows)


@dataclass(frozen=True)
class TopologyPlan:
    axes: Tuple[Tuple[str, int], ...]
    sharding_stage: int
    meshes: Tuple[Mesh, ...]
    horizontal_axes: Tuple[str, ...]
    replica_axes: Tuple[str, ...]

    @property
    def world_size(self) -> int:
        return math.prod(d for _, d in self.axes)

    @property
    def num_splits(self) -> int:
        return len(self.meshes)

    def mesh_of(self, rank: int) -> Mesh:
        return self.meshes[self._mesh_index()[rank]]

    def _mesh_index(self) -> Dict[int, int]:
        return {r: m.index for m in self.meshes for r in m.ranks}

    def export_groups(self) -> List[Tuple[int, ...]]:
        """The export's own process groups, in the one order every rank creates them: the whole world
        (decisions, plans, statuses), then each mesh's rows and columns of more than one rank (the
        assembler's collectives). Each group lists its ranks in mesh order (a row by horizontal index,
        a column by pipe index), which is the order its gathers return.

        >>> plan_topology([("pipe", 2), ("model", 2)]).export_groups()
        [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)]
        >>> plan_topology([("data", 2)]).export_groups()
        [(0, 1)]
        """
        groups: List[Tuple[int, ...]] = [tuple(range(self.world_size))]
        for m in self.meshes:
            groups += [tuple(row) for row in m.rows if len(row) > 1]
            if len(m.rows) > 1:
                groups += [tuple(col) for col in zip(*m.rows)]
        return groups

    def as_dict(self) -> dict:
        return {
            "axes": [list(a) for a in self.axes],
            "sharding_stage": self.sharding_stage,
            "world_size": self.world_size,
            "horizontal_axes": list(self.horizontal_axes),
            "replica_axes": list(self.replica_axes),
            "num_splits": self.num_splits,
            "meshes": [{"h": [list(r) for r in m.rows], "v": [list(c) for c in zip(*m.rows)]} for m in self.meshes],
        }


def normalize_axes(axes: Sequence[Tuple[str, int]]) -> Tuple[Tuple[str, int], ...]:
    out, seen = [], set()
    for name, degree in axes:
        canon = AXIS_ALIASES.get(str(name).lower())
        if canon is None:
            raise ValueError(f"unknown parallel axis {name!r}; known: {sorted(set(AXIS_ALIASES.values()))}")
        if canon in seen:
            raise ValueError(f"parallel axis {canon!r} given twice")
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"degree of axis {canon!r} must be a whole number >= 1, got {degree!r}")
        seen.add(canon)
        out.append((canon, degree))
    return tuple(out)


def plan_topology(axes: Sequence[Tuple[str, int]], sharding_stage: int = 1,
                  expert_axes: Sequence[str] = ()) -> TopologyPlan:
    """Meshes of a hybrid topology.

    ``expert_axes``: axes over which a MoE model places different experts on different ranks
    (PaddleFormers' ``moe_group``: "data" or "model"; a dedicated ``expert`` axis is always one).
    They join the mesh: an expert held whole by one rank of the axis is gathered from its owner,
    while dense parameters are replicas inside the mesh; only the remaining replica axes split the
    export.

    >>> p = plan_topology([("data", 2), ("pipe", 1), ("sharding", 1), ("sep", 1), ("model", 2)])
    >>> [m.rows for m in p.meshes]
    [((0, 1),), ((2, 3),)]
    >>> [m.rows for m in plan_topology([("pipe", 2), ("model", 2)]).meshes]
    [((0, 1), (2, 3))]
    """
    if sharding_stage not in (0, 1, 2, 3):
        raise ValueError(f"sharding stage must be 0, 1, 2 or 3, got {sharding_stage!r}")
    axes = normalize_axes(axes)
    names = [n for n, _ in axes]
    degrees = [d for _, d in axes]
    horizontal = {"model", "expert"} | ({"sharding"} if sharding_stage == 3 else set())
    for name in expert_axes:
        canon = AXIS_ALIASES.get(str(name).lower())
        if canon is None or canon == "pipe":
            raise ValueError(f"experts cannot be placed over axis {name!r}")
        horizontal.add(canon)
    h_axes = tuple(n for n in names if n in horizontal)
    v_axes = tuple(n for n in names if n == "pipe")
    r_axes = tuple(n for n in names if n not in horizontal and n != "pipe")
    strides = [math.prod(degrees[i + 1:]) for i in range(len(degrees))]
    pos = {n: i for i, n in enumerate(names)}

    def rank_of(coords: Dict[str, int]) -> int:
        return sum(coords.get(n, 0) * strides[pos[n]] for n in names)

    def combos(axis_names):
        return list(itertools.product(*[range(degrees[pos[n]]) for n in axis_names]))

    meshes = []
    for mi, rc in enumerate(combos(r_axes)):
        base = dict(zip(r_axes, rc))
        rows = []
        for vc in combos(v_axes):
            rows.append(tuple(rank_of({**base, **dict(zip(v_axes, vc)), **dict(zip(h_axes, hc))}) for hc in combos(h_axes)))
        meshes.append(Mesh(mi, tuple(rows)))
    return TopologyPlan(axes, sharding_stage, tuple(meshes), h_axes, r_axes)


def _lpt(sizes: Sequence[int], bins: int) -> List[int]:
    """Largest first to the least loaded bin; ties to the lowest index. Deterministic."""
    load = [0] * bins
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda j: (load[j], j))
        owner[i] = b
        load[b] += sizes[i]
    return owner


@dataclass(frozen=True)
class WritePlan:
    """Which mesh assembles each file and which rank writes it."""

    file_mesh: Tuple[int, ...]  # file index -> mesh index
    file_writer: Tuple[int, ...]  # file index -> rank

    def files_of_rank(self, rank: int) -> List[int]:
        return [i for i, r in enumerate(self.file_writer) if r == rank]

    def files_of_mesh(self, mesh: int) -> List[int]:
        return [i for i, m in enumerate(self.file_mesh) if m == mesh]

    def writers(self) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for i, r in enumerate(self.file_writer):
            out.setdefault(r, []).append(i)
        return out


def plan_writes(topology: TopologyPlan, file_sizes: Sequence[int]) -> WritePlan:
    """Split files across meshes (balanced bytes: the assembly work), then across each mesh's ranks.

    >>> t = plan_topology([("data", 2), ("model", 2)])
    >>> w = plan_writes(t, [40, 30, 20, 10])
    >>> w.file_mesh, w.file_writer
    ((0, 1, 1, 0), (0, 2, 3, 1))
    """
    file_mesh = _lpt(file_sizes, topology.num_splits)
    file_writer = [0] * len(file_sizes)
    for mesh in topology.meshes:
        files = [i for i, m in enumerate(file_mesh) if m == mesh.index]
        owners = _lpt([file_sizes[i] for i in files], mesh.size)
        for f, o in zip(files, owners):
            file_writer[f] = mesh.ranks[o]
    return WritePlan(tuple(file_mesh), tuple(file_writer))
