"""Where the full tensors come from: the assembler that fits the source and the mesh.

``stream_tensors`` yields ``(destination name, full tensor as a host array)`` in the plan's file
order, for the destinations of this rank's mesh; every rank of the mesh takes part in its collectives even when
it keeps none of them (``keep``: the destinations this rank writes).
"""
from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ...assemble.device import DeviceBoundary
from ...assemble.local import LocalAssembler
from ...assemble.mapping import MappingError
from ...assemble.mesh import MeshAssembler
from ...assemble.routed import RoutedAssembler
from ...config.schema import FullParamConfig
from ..source import ModelSource
from .planning import PreparedExport

logger = logging.getLogger("paddle_fullparam_callbacks")


def stream_tensors(ctx, config: FullParamConfig, sd, p: PreparedExport, source: ModelSource,
                   targets: List[str], keep: set, room=None, boundary: Optional[DeviceBoundary] = None,
                   traffic: Optional[dict] = None, beat=None) -> Iterator[Tuple[str, np.ndarray]]:
    """``room(nbytes)``: waits until the writer can take a tensor that large (file sources only: a live
    model's tensors exist already, a file's are read on demand). ``boundary``: where a live model's
    slices leave the device (``export.device_memory_budget``). ``traffic``: filled with what this rank sent
    and received (bytes; the routed and seed schedules). ``beat()``: progress inside the assembly (a packet
    sent or received: a rank that writes little still shows the watchdog it is moving)."""
    boundary = boundary or DeviceBoundary(config.export.device_budget)
    mapped = config.export.format != "paddle_safetensors"
    if source.tensors is not None:  # slices in files (convert): read and assembled here, no communication
        from ...assemble.files import FileAssembler

        wait = None if room is None else (lambda name: room(p.plan.slots[name].nbytes))
        asm = FileAssembler(source.tensors, p.dmap, config.export.dtype, room=wait)
        yield from asm.run([n for n in targets if n in keep])
        return
    if config.assembler == "paddle":
        from ...assemble.paddle_ref import run_paddle_full_param

        if ctx.world_size == 1 or ctx.mesh.size > 1:
            # Paddle's HV path needs both groups (a one-rank group for a 1-D mesh); each mesh
            # assembles everything (Paddle splits by sorted names, not by our files) and keeps its own
            kwargs = {}
            if ctx.mesh.size > 1:
                kwargs = {"h_group": ctx.paddle_h_group, "v_group": ctx.paddle_v_group}
                rows = [list(kwargs["h_group"].ranks), list(kwargs["v_group"].ranks)] if ctx.paddle_h_group else None
                if rows != [list(ctx.mesh.h_ranks(ctx.rank)), list(ctx.mesh.v_ranks(ctx.rank))]:
                    raise MappingError("assembler=paddle runs Paddle's full_param over the job's tensor-parallel and "
                                       "pipeline groups, which are not this mesh's rows and columns here (e.g. sharding "
                                       "stage 3 joins the mesh): use assembler=builtin")
            for name, t in run_paddle_full_param(sd, source.aoa_config if mapped else None, config.export.dtype,
                                                 transforms=source.local_transforms, **kwargs):
                if name in keep:
                    yield name, t
            return
        # a mesh of one inside a multi-rank job: Paddle's full_param would take its
        # single-group path (it decides by the world size) and call .cuda(); assemble locally
        logger.warning("assembler=paddle: a mesh of one rank uses the builtin local assembler (no communication)")
    if ctx.mesh.size == 1:
        yield from LocalAssembler(sd, p.dmap, config.export.dtype, source.local_transforms, boundary).run(
            [n for n in targets if n in keep])
        return
    if p.routes is not None:
        asm = RoutedAssembler(sd, p.dmap, p.routes, [n for n in targets if n in keep], ctx.rank, ctx.pair_groups,
                              config.export.dtype, source.local_transforms, boundary, dict(enumerate(ctx.nodes)),
                              {r.key: (config.export.dtype if r.key in p.early_cast else r.dtype) for r in p.records},
                              on_packet=beat, early_cast=p.early_cast)
        _check_replicas(ctx, lambda: replica_digests(p.records, ctx.rank, asm.local_bytes))
    else:
        asm = MeshAssembler(sd, p.records, p.dmap, targets, keep, ctx.mesh, ctx.rank, ctx.h_group, ctx.v_group,
                            config.export.dtype, config.topology.bucket_for(ctx.mesh.size), source.local_transforms,
                            boundary)
        _check_replicas(ctx, lambda: replica_digests(p.records, ctx.rank, asm.whole_local_bytes))
    try:
        yield from asm.run()
    finally:
        if traffic is not None:
            traffic.update(asm.stats)
            if p.routes is not None:  # beside what it did, what the plan said it would do
                planned = p.routes.traffic.get(ctx.rank)
                traffic["predicted_received"] = planned.received if planned else 0
                traffic["predicted_sent"] = planned.sent if planned else 0
    if asm.errors:
        raise MappingError(asm.errors[0])


def replica_digests(records, rank: int, local_bytes) -> Dict[tuple, str]:
    """sha256 of this rank's copy of every slice that several ranks of its mesh hold (replicas), by
    (key, offset, shape); ``local_bytes(key)``: this rank's slice as flat host bytes."""
    import hashlib

    holders: Dict[tuple, set] = {}
    for r in records:
        holders.setdefault((r.key, tuple(r.offset), tuple(r.shape)), set()).add(r.rank)
    return {ident: hashlib.sha256(memoryview(local_bytes(ident[0]))).hexdigest()[:32]
            for ident, ranks in sorted(holders.items()) if len(ranks) > 1 and rank in ranks}


def _check_replicas(ctx, digests) -> None:
    """Replicas inside the mesh must agree before one holder's copy stands for all. ``digests()``: this rank's
    (an error in it is shared, not raised alone: every rank of the mesh is in the exchange)."""
    try:
        mine, error = digests(), None
    except Exception as e:
        logger.debug("rank %d: replica digests failed", ctx.rank, exc_info=True)
        mine, error = {}, f"{type(e).__name__}: {e}"
    held = ctx.mesh_gather_object((mine, error), "assembly: replica digests")
    failed = [(r, e) for r, (_, e) in zip(ctx.mesh.ranks_in_gather_order(), held) if e]
    if failed:
        raise MappingError(f"rank {failed[0][0]} could not read its replicated slices: {failed[0][1]}")
    merged: Dict[tuple, Dict[str, int]] = {}
    for r, (per_rank, _) in zip(ctx.mesh.ranks_in_gather_order(), held):
        for ident, d in per_rank.items():
            merged.setdefault(ident, {}).setdefault(d, r)
    for (key, offset, _), by_digest in sorted(merged.items()):
        if len(by_digest) > 1:
            raise MappingError(
                f"parameter {key!r}: ranks {sorted(by_digest.values())} hold the same slice at "
                f"{list(offset)} with different values (replicas out of sync)"
            )


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


def progress_bar(show: bool, total: int, name: str):
    """A tqdm bar on the coordinator, shown only when the export takes more than 2 seconds."""
    if not show:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"export {name}", delay=2.0, leave=False)
