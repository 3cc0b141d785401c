"""Companions of a snapshot (``ModelSource.companions``, e.g. a PEFT adapter): assembled and written
into a subdirectory of the staging directory, so the snapshot's own commit makes them visible.

After the snapshot's tensors, the ranks of the coordinator's mesh exchange the companion's slice
records (one exchange), build its destinations from the snapshot's mapping, assemble them with the
same assemblers as the snapshot (the coordinator keeps them all), and the coordinator writes one
safetensors file with the plan's header and its JSON files beside it. Other meshes hold the same
tensors (replicas) and take no part. A companion is small next to the model (a LoRA adapter is
r x (in + out) per layer), so it goes to one file, written synchronously.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

from ...assemble.local import LocalAssembler
from ...assemble.mapping import DestinationMap, MappingError
from ...assemble.mesh import MeshAssembler, records_from_state_dict, shard_info_from_records, validate_records
from ...config.schema import FullParamConfig
from ...plan.export_plan import build_export_plan, natural_key
from .. import commit
from ..commit.manifest import describe_files
from ..source import Companion, ModelSource
from ..write.writer import SnapshotWriter
from .host import to_host_array
from .planning import PreparedExport

_ONE_FILE = 1 << 62


def write_companions(ctx, config: FullParamConfig, p: PreparedExport, source: ModelSource,
                     staging: Optional[Path], boundary=None) -> Dict[str, dict]:
    """Every rank calls it; returns, on the coordinator, {directory: {file: (bytes, digest)}}.
    ``boundary``: the export's ``DeviceBoundary`` (the companions' slices leave the device there too)."""
    out: Dict[str, dict] = {}
    if ctx.coordinator not in ctx.mesh.ranks:
        return out
    for comp in source.companions:
        files = _one(ctx, config, p, comp, staging, boundary)
        if files is not None:
            out[comp.directory] = files
    return out


def companion_layout(ctx, p: PreparedExport, comp: Companion) -> Optional[Tuple[DestinationMap, Dict[str, object]]]:
    """What ``comp`` will hold, as its export will write it: its destinations (names, shapes, dtypes) and its JSON
    files; for a start's checks (a LoRA run served as adapters proves its engines take that adapter). Every rank
    of the coordinator's mesh calls it (one exchange); None on the others. Raises what the destinations raise
    (e.g. ``LoraError`` for a layout peft cannot describe)."""
    if ctx.coordinator not in ctx.mesh.ranks:
        return None
    dmap, _, _ = _destinations(ctx, p, comp)
    return dmap, {f: (obj(p.dmap, dmap) if callable(obj) else obj) for f, obj in comp.json_files.items()}


def _destinations(ctx, p: PreparedExport, comp: Companion):
    """(the companion's DestinationMap, this rank's sharded state dict or None, every mesh rank's records)."""
    sd = comp.sharded_state_dict() if comp.tensors is None else None
    if comp.tensors is not None:
        records = list(comp.tensors.records())
    else:
        local = records_from_state_dict(ctx.rank, sd)
        records = [r for per_rank in ctx.mesh_gather_object(local, "companion: shard records") for r in per_rank]
    validate_records(records)
    return comp.destinations(p.dmap, shard_info_from_records(records)), sd, records


def _one(ctx, config, p: PreparedExport, comp: Companion, staging: Optional[Path], boundary) -> Optional[dict]:
    mine = ctx.rank == ctx.coordinator
    dmap, sd, records = _destinations(ctx, p, comp)
    names = sorted(dmap.entries, key=natural_key)
    if comp.tensors is not None:
        if not mine:
            return None
        from ...assemble.files import FileAssembler

        stream = FileAssembler(comp.tensors, dmap).run(names)
    elif ctx.mesh.size == 1:
        stream = LocalAssembler(sd, dmap, boundary=boundary).run(names if mine else [])
    else:
        asm = MeshAssembler(sd, records, dmap, names, set(names) if mine else set(), ctx.mesh, ctx.rank,
                            ctx.h_group, ctx.v_group, "keep", config.topology.bucket_for(ctx.mesh.size),
                            boundary=boundary)
        stream = asm.run()
    tensors = {name: to_host_array(t) for name, t in stream}
    if comp.tensors is None and ctx.mesh.size > 1 and asm.errors:
        raise MappingError(asm.errors[0])
    if not mine or staging is None:
        return None
    directory = staging / comp.directory
    directory.mkdir()
    plan = build_export_plan(dmap.specs, _ONE_FILE, prefix=comp.file_prefix, metadata=comp.metadata)
    writer = SnapshotWriter(plan, directory, None, max_pending_bytes=config.export.max_pending, background=False)
    try:
        for name in plan.files[0].slots:
            writer.put(name.name, tensors.pop(name.name))
        results = writer.close()
    except BaseException:
        writer.abort()
        raise
    for fname, obj in comp.json_files.items():
        commit.write_json_durable(directory / fname, obj(p.dmap, dmap) if callable(obj) else obj)
    commit.fsync_dir(directory)
    described = {r.name: (r.bytes, r.digest) for r in results.values()}
    described.update(describe_files(directory, list(comp.json_files)))
    return described
