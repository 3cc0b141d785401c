"""The export plan of a job: mapping, destination tensors, shard files, who writes what.

Computed from every mesh rank's shard records (one exchange), checked for consistency, and
agreed on by every rank (a digest exchange: a rank alone in a collective would hang). Cached by
the session: recomputed only when some rank's parameter names, shapes or dtypes change.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ... import _faults
from ...assemble.device import on_device
from ...assemble.local import castable_early
from ...assemble.mapping import DestinationMap, MappingError, apply_export_dtype, build_destination_map, padding_destinations
from ...assemble import mesh
from ...assemble.mesh import records_from_state_dict, shard_info_from_records, validate_records
from ...assemble.routed import holdings_of, needs_of
from ...config.schema import FullParamConfig
from ...plan.export_plan import ExportPlan, build_export_plan
from ...plan.placement import plan_placement
from ...plan.quantization import MISREAD, Fp8Plan, plan_fp8
from ...plan.routing import RoutePlan, plan_routes
from ...plan.topology import WritePlan, plan_writes
from ..source import ExportError, ModelSource

logger = logging.getLogger("paddle_fullparam_callbacks")


@dataclass
class PreparedExport:
    signature: str
    records: list
    dmap: DestinationMap
    plan: ExportPlan
    order: List[str]  # destination names in file order
    writes: WritePlan
    zero_rows: Dict[str, int] = field(default_factory=dict)  # destination -> row written as zeros
    routes: Optional[RoutePlan] = None  # topology.schedule=routed, a mesh of several ranks: this mesh's moves
    balance: float = 1.0  # the largest writer's bytes / the mean
    balance_note: str = ""
    early_cast: frozenset = frozenset()  # routed: source keys their holders cast to export.dtype before sending
    fp8: Optional[Fp8Plan] = None  # export.quantization=fp8: the weights the writers quantize, their scales


def digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def _flattened_error(flattened: List[str]) -> MappingError:
    more = f" and {len(flattened) - 3} more" if len(flattened) > 3 else ""
    return MappingError(
        f"parameter(s) {flattened[:3]}{more} are flattened shards (is_flattened: sharding stage 1 v2 "
        "or stage 3 with tensor fusion): the exporter needs every rank's block of each tensor (its global "
        "offset and shape); export from a job without tensor fusion, or convert its saved checkpoint")


def _check_whole(records) -> None:
    for r in records:
        if r.shape != r.global_shape:
            raise MappingError(
                f"parameter {r.key!r} is a slice {list(r.shape)} of {list(r.global_shape)} on rank {r.rank}, "
                "but the topology gives this rank a mesh of one: the parallel axes do not match the job"
            )


def _check_paddle_assembler(sd) -> None:
    """assembler=paddle runs Paddle's ``full_param``, which assembles where the parameters are."""
    on_acc = sorted(k for k, sw in sd.items() if on_device(sw.local_tensor))
    if on_acc:
        raise MappingError(f"assembler=paddle runs Paddle's own full_param, which assembles on the device without a "
                           f"bound (export.device_memory_budget); {len(on_acc)} parameter(s) are on "
                           f"{sd[on_acc[0]].local_tensor.place} (e.g. {on_acc[0]!r}): use assembler=builtin")


def quantization_plan(config: FullParamConfig, source: ModelSource, specs, zero_rows) -> Optional[Fp8Plan]:
    """export.quantization=fp8: the declared weights of the snapshot (``source.quantization``) as FP8."""
    if config.export.quantization == "none":
        return None
    if source.quantization is None:
        raise MappingError(f"export.quantization={config.export.quantization} needs the architecture's declaration of "
                           "the weights it quantizes; this model source has none")
    selected, not_convert = source.quantization([(s.name, s.shape) for s in specs])
    rows = sorted(set(selected) & set(zero_rows))
    if rows:  # embeddings are never declared: a declaration that says otherwise is wrong
        raise MappingError(f"{rows[0]!r} is declared for FP8 but has a padding row to zero (an embedding)")
    return plan_fp8(specs, selected, not_convert, config.export.quantization_block)


def plan_export(ctx, config: FullParamConfig, source: ModelSource, sd: Optional[dict],
                cached: Optional[PreparedExport] = None) -> PreparedExport:
    """The plan for ``source`` (``sd``: its sharded state dict, None for a file source).

    A collective on every rank (cheap when nothing changed: one digest exchange); ``cached`` is
    returned when every rank's parameters are those it was computed from.
    """
    _faults.point("plan")
    from_files = source.tensors is not None
    local = list(source.tensors.records()) if from_files else records_from_state_dict(ctx.rank, sd)
    sig = digest(sorted((r.rank if from_files else 0, r.key, r.offset, r.shape, r.global_shape, r.dtype)
                        for r in local))
    world_sig = digest(ctx.all_gather_object(sig, what="plan: parameter signatures"))
    if cached is not None and cached.signature == world_sig:
        return cached
    # with each rank's records, its padding rows: the pipeline stage holding the embedding tells the writer
    flat = [] if from_files else sorted(k for k, sw in sd.items() if getattr(sw, "is_flattened", False))
    gathered = ctx.mesh_gather_object((local, source.padding_rows, flat), "plan: shard records")
    records = [r for per_rank, _, _ in gathered for r in per_rank]
    padding_rows = {k: v for _, rows, _ in gathered for k, v in rows.items()}
    flattened = sorted({k for _, _, keys in gathered for k in keys})
    mapped = config.export.format != "paddle_safetensors"
    error, prepared, plan_digest = None, None, None
    try:
        if flattened:
            raise _flattened_error(flattened)
        validate_records(records)
        if config.assembler == "paddle" and not from_files:
            _check_paddle_assembler(sd)
        if ctx.mesh.size == 1 and not from_files:
            _check_whole(records)
        if mapped and source.mapping_for is not None:
            source.aoa_config = source.mapping_for({r.key: tuple(r.global_shape) for r in records})
        dmap = build_destination_map(shard_info_from_records(records), source.aoa_config if mapped else None)
        if source.check_mapping is not None:
            source.check_mapping(dmap)
        zero_rows = padding_destinations(dmap, padding_rows)
        specs = apply_export_dtype(dmap.specs, config.export.dtype)
        fp8 = quantization_plan(config, source, specs, zero_rows)
        specs = fp8.specs(specs) if fp8 is not None else specs
        routes, balance, note = None, 1.0, ""
        early: frozenset = frozenset()
        if config.topology.schedule == "routed" and not from_files and ctx.world_size > 1:
            # sources cast to the snapshot's dtype by their holder, before they travel (bytes of that dtype move)
            names = [s.name for s in specs if s.companion_of is None]  # a companion is made by its tensor's writer
            early = frozenset(castable_early(dmap, names, config.export.dtype, source.local_transforms or {}))
            needs = needs_of(dmap, names)
            holdings = holdings_of(records, {k: config.export.dtype for k in early})
            placed = plan_placement(specs, needs, holdings, ctx.topology, ctx.mesh.index,
                                    config.export.max_shard_bytes, dict(enumerate(ctx.nodes)))
            plan, writes, balance, note = placed.plan, placed.writes, placed.balance, placed.note
            order = plan.assembled()
            if ctx.mesh.size > 1:
                mine = set(writes.files_of_mesh(ctx.mesh.index))
                mesh_order = [n for n in order if plan.slots[n].file_index in mine]
                routes = plan_routes(mesh_order, {n: writes.file_writer[plan.slots[n].file_index] for n in mesh_order},
                                     needs, holdings, dict(enumerate(ctx.nodes)),
                                     config.topology.bucket_for(1), mesh.BCAST_CHUNK_BYTES)  # (read now: tests shrink it)
        else:
            plan = build_export_plan(specs, config.export.max_shard_bytes)
            order = plan.assembled()
            writes = plan_writes(ctx.topology, [f.total_bytes for f in plan.files])
        prepared = PreparedExport(world_sig, records, dmap, plan, order, writes, zero_rows, routes, balance, note, early, fp8)
        plan_digest = digest([[(f.name, f.header) for f in plan.files], writes])
    except Exception as e:  # reported on every rank below, never raised alone
        error = f"{type(e).__name__}: {e}"
    # every rank must hold the same plan: a rank alone in a collective would hang
    outcomes = ctx.all_gather_object((error, plan_digest), what="plan: digests")
    errors = [e for e, _ in outcomes if e]
    if errors:
        raise ExportError(f"export planning failed: {errors[0]}")
    if len({d for _, d in outcomes}) != 1:
        raise ExportError(
            "ranks computed different export plans (their models differ in names, shapes or dtypes, "
            "or their configs differ); refusing to export"
        )
    if prepared.fp8 is not None and prepared.fp8.misread and ctx.is_coordinator:
        names = prepared.fp8.misread
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        logger.warning("export.quantization: %d weight(s) have a dimension that is not a multiple of the block %s "
                       "and spans several blocks (%s%s): %s", len(names), list(prepared.fp8.block),
                       ", ".join(names[:3]), more, MISREAD)
    return prepared
