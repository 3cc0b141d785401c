"""An export's traffic predicted before any job starts: how a hybrid-parallel job holds a model's tensors,
then the placement and routing plans a real export would make from that, rank by rank.

How a job holds a tensor (Megatron's and Paddle's layout, in Hugging Face's ``[out, in]`` terms): a
pipeline stage holds a contiguous run of layers (the embedding on the first, the final norm and the head
on the last); inside a stage's row, column-parallel weights (q, k, v, gate, up, an expert's w1/w3, the
head, the embedding's vocabulary rows) are split on their first axis over the tensor-parallel ranks,
row-parallel ones (o, down, an expert's w2) on their second, the rest (norms, a router) replicated; an
expert lives on the expert-parallel rank that owns it (experts in equal contiguous runs), split over the
tensor-parallel ranks like any Linear. Replica axes (data, sharding 1/2, sep) hold copies.

Pure: the caller gives the shapes (``model_shapes.py``), the topology and the nodes.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Dict, List, Mapping, Optional, Tuple

from .. import _dtypes
from .boxes import Holding, HoldingIndex, Need
from .export_plan import TensorSpec
from .placement import plan_placement
from .routing import plan_routes
from .topology import Mesh, TopologyPlan

_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|\.w1|\.w3|lm_head|embed_tokens)\.weight$")
_ROW = re.compile(r"(o_proj|down_proj|\.w2)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _h_coords(topology: TopologyPlan) -> List[Dict[str, int]]:
    """Each horizontal index of a mesh row as {axis: coordinate} (Paddle's order: the last axis fastest)."""
    degrees = dict(topology.axes)
    axes = [a for a, _ in topology.axes if a in topology.horizontal_axes]
    out = []
    for flat in range(math.prod(degrees[a] for a in axes) if axes else 1):
        coords, rest = {}, flat
        for a in reversed(axes):
            coords[a], rest = rest % degrees[a], rest // degrees[a]
        out.append(coords)
    return out


def _split(shape, axis: int, parts: int, k: int, name: str):
    if shape[axis] % parts:
        raise ValueError(f"{name} {list(shape)}: axis {axis} ({shape[axis]}) does not split into {parts} equal parts")
    n = shape[axis] // parts
    off = [0] * len(shape)
    off[axis] = k * n
    sh = list(shape)
    sh[axis] = n
    return tuple(off), tuple(sh)


def job_holdings(shapes: Mapping[str, Tuple[int, ...]], dtype: str, topology: TopologyPlan,
                 mesh: Optional[Mesh] = None) -> List[Holding]:
    """What each rank of ``mesh`` (default the first) holds of ``shapes``, by the module's layout."""
    if topology.sharding_stage == 3 and "sharding" in topology.horizontal_axes:
        raise ValueError("a prediction for sharding stage 3 (parameters sharded inside the mesh) is not modeled; "
                         "give --sharding-stage 1 or 2")
    mesh = mesh or topology.meshes[0]
    itemsize = _dtypes.lookup(dtype).itemsize
    coords = _h_coords(topology)
    mp = dict(topology.axes).get("model", 1)
    expert_axes = [a for a in topology.horizontal_axes if a not in ("model", "sharding")]
    ep = math.prod(dict(topology.axes)[a] for a in expert_axes) if expert_axes else 1
    stages = len(mesh.rows)
    layers = 1 + max((int(m.group(1)) for n in shapes if (m := _LAYER.search(n))), default=-1)
    per_stage = math.ceil(layers / stages) if layers else 1
    experts = 1 + max((int(m.group(1)) for n in shapes if (m := _EXPERT.search(n))), default=-1)
    if experts and experts % ep:
        raise ValueError(f"{experts} experts do not spread evenly over {ep} expert-parallel ranks")
    out = []
    for name, shape in shapes.items():
        layer = _LAYER.search(name)
        v = (int(layer.group(1)) // per_stage if layer else
             0 if "embed_tokens" in name else stages - 1)
        expert = _EXPERT.search(name)
        axis = 0 if _COLUMN.search(name) else 1 if _ROW.search(name) else None
        for h, c in enumerate(coords):
            e = sum(c[a] * math.prod(dict(topology.axes)[b] for b in expert_axes[i + 1:])
                    for i, a in enumerate(expert_axes))
            if expert and int(expert.group(1)) // (experts // ep) != e:
                continue
            if axis is None or mp == 1 or len(shape) < 2:
                off, sh = (0,) * len(shape), tuple(shape)
            else:
                off, sh = _split(shape, axis, mp, c.get("model", 0), name)
            out.append(Holding(mesh.rows[v][h], name, off, sh, itemsize))
    return out


def _seed_received(specs, needs, holdings, mesh: Mesh) -> Dict[int, int]:
    """The seed schedule's deliveries: every rank of the mesh receives every slice the mesh reads, but those
    it sends itself (each slice from its least loaded holder, as ``assemble/mesh.plan_read_items``)."""
    index = HoldingIndex(holdings)
    items: Dict[tuple, Tuple[int, Tuple[int, ...]]] = {}
    for s in specs:
        for need in needs[s.name]:
            for piece in index.pieces(need):  # (whole tensors here: each piece is a held slice)
                items.setdefault((piece.key, piece.offset, piece.shape), (piece.nbytes, piece.holders))
    load: Dict[int, int] = defaultdict(int)
    total = 0
    for _, (n, holders) in items.items():
        src = min(holders, key=lambda r: (load[r], r))
        load[src] += n
        total += n
    return {r: total - load[r] for r in mesh.ranks}


def predict(shapes: Mapping[str, Tuple[int, ...]], dtype: str, topology: TopologyPlan, max_shard_size: int,
            node_of: Optional[Mapping[int, int]] = None, bucket_bytes: int = 2 * 2**20) -> dict:
    """Per rank: bytes written, received and sent (inside and across nodes) by the routed schedule, the floor
    (bytes its files need that it does not hold), and what the seed schedule would deliver to it."""
    specs = [TensorSpec(n, s, dtype) for n, s in shapes.items()]
    needs = {n: [Need(n, n, (0,) * len(s), tuple(s))] for n, s in shapes.items()}
    mesh0 = topology.meshes[0]
    placed = plan_placement(specs, needs, job_holdings(shapes, dtype, topology, mesh0), topology, 0, max_shard_size,
                            node_of)
    order = [s.name for f in placed.plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
    writer_file = placed.writes.file_writer
    ranks: Dict[int, Dict[str, int]] = {r: defaultdict(int) for m in topology.meshes for r in m.ranks}
    for f, w in zip(placed.plan.files, writer_file):
        ranks[w]["writes"] += f.total_bytes
    for mesh in topology.meshes:
        holdings = job_holdings(shapes, dtype, topology, mesh)
        mine = set(placed.writes.files_of_mesh(mesh.index))
        names = [n for n in order if placed.plan.slots[n].file_index in mine]
        routes = plan_routes(names, {n: writer_file[placed.plan.slots[n].file_index] for n in names}, needs,
                             holdings, node_of, bucket_bytes)
        for r, t in routes.traffic.items():
            for k, v in t.as_dict().items():
                ranks[r][k] += v
        index, seen = HoldingIndex(holdings), set()
        for n in names:  # the floor, by its definition: each byte a writer's files need and it lacks, once
            w = writer_file[placed.plan.slots[n].file_index]
            for piece in index.pieces(needs[n][0]):
                if w not in piece.holders and (w, piece.key, piece.offset, piece.shape) not in seen:
                    seen.add((w, piece.key, piece.offset, piece.shape))
                    ranks[w]["floor"] += piece.nbytes
        if mesh.size > 1:
            for r, n in _seed_received([s for s in specs if s.name in set(names)], needs, holdings, mesh).items():
                ranks[r]["seed_received"] += n
    snapshot = sum(f.total_bytes for f in placed.plan.files)
    return {"snapshot_bytes": snapshot, "files": len(placed.plan.files), "balance": placed.balance,
            "balance_note": placed.note, "ranks": {r: dict(v) for r, v in sorted(ranks.items())},
            "nodes": {r: (node_of or {}).get(r, 0) for r in sorted(ranks)}}


__all__ = ["job_holdings", "predict"]
