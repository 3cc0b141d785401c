"""One export, end to end: plan (cached), assemble, write, commit, point ``latest``, retain.

The same flow serves one process and many ranks (``ctx``: see ``distributed.py``):

1. metadata: the mesh's shard records (one exchange, the first time), checked for consistency;
2. mapping and plans: destination tensors, shard files, the split of files across meshes and
   writers; every rank must compute the same export plan (checked by a digest exchange);
3. the coordinator creates the staging directory and tells everyone its name;
4. each mesh assembles its split; each rank writes only its own files, all at the same time;
5. status exchange: every rank learns whether every rank succeeded, and the per-file sizes and
   sha256; on any failure everyone raises the same error and the coordinator removes staging;
6. the coordinator writes index, config, tokenizer, manifest (last), renames, updates
   ``latest`` and retention; a last exchange tells everyone the outcome.

Everything that can be checked is checked before the first byte. A failure after that removes
the staging directory: nothing half-written stays visible.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..assemble.local import LocalAssembler
from ..assemble.mapping import DestinationMap, MappingError, apply_export_dtype, build_destination_map
from ..assemble.mesh import (
    MeshAssembler,
    records_from_state_dict,
    shard_info_from_records,
    validate_records,
)
from ..config.schema import FullParamConfig
from ..plan.export_plan import ExportPlan, build_export_plan
from ..plan.naming import format_snapshot_name, snapshot_step_pattern
from ..plan.topology import WritePlan, plan_writes
from . import commit
from .distributed import LocalContext
from .exporters import Exporter, make_exporter
from .manifest import build_manifest, describe_files, dominant_float_dtype

logger = logging.getLogger("paddle_fullparam_callbacks")


class ExportError(RuntimeError):
    """An export failed; nothing of it was committed."""


@dataclass
class ModelSource:
    """What the export needs from the model, gathered by the integrations layer."""

    sharded_state_dict: Callable[[], dict]
    aoa_config: Optional[dict] = None
    hf_config: Optional[dict] = None
    generation_config: Optional[dict] = None
    tokenizer: Any = None
    framework: str = "paddle"
    check_names: Optional[Callable] = None  # called with the destination names of a new mapping


@dataclass
class SnapshotInfo:
    name: str
    step: int
    path: Optional[Path]
    files: int
    bytes: int
    num_tensors: int
    seconds: float
    timings: Dict[str, float] = field(default_factory=dict)
    reason: str = ""
    peak_pending_bytes: int = 0
    files_written_here: int = 0


@dataclass
class _Prepared:
    signature: str
    records: list
    dmap: DestinationMap
    plan: ExportPlan
    order: List[str]  # destination names in file order
    writes: WritePlan


def _digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


class ExportSession:
    """Holds what stays the same across a job's exports (the mapping and the plans)."""

    def __init__(self, config: FullParamConfig, output_dir: "str | Path", fn: Optional[Callable] = None, ctx=None):
        self.config = config
        self.output_dir = Path(output_dir)
        self.fn = fn
        self.ctx = ctx or LocalContext()
        self._prepared: Optional[_Prepared] = None
        self.pattern = snapshot_step_pattern(config.export.name_template)

    def start(self) -> List[str]:
        """Check output_dir and remove leftovers of interrupted exports (coordinator); all ranks call it."""
        removed: List[str] = []
        error = None
        if self.ctx.is_coordinator and self.config.export.format != "callable":
            try:
                commit.check_output_dir(self.output_dir)
                removed = commit.cleanup_stale(self.output_dir)
            except OSError as e:
                error = str(e)
        errors = [e for e in self.ctx.all_gather_object(error) if e]
        if errors:
            raise OSError(errors[0])
        if removed:
            logger.info("removed %d leftover(s) of interrupted exports in %s: %s", len(removed), self.output_dir, removed)
        return removed

    # ---- planning ----------------------------------------------------------------------
    def prepare(self, source: ModelSource, sharded_state_dict: Optional[dict] = None) -> _Prepared:
        """Mapping and plans; recomputed only when some rank's parameter names, shapes or dtypes change.

        A collective on every rank (cheap when nothing changed: one digest exchange).
        """
        ctx = self.ctx
        sd = source.sharded_state_dict() if sharded_state_dict is None else sharded_state_dict
        local = records_from_state_dict(ctx.rank, sd)
        sig = _digest(sorted((r.key, r.offset, r.shape, r.global_shape, r.dtype) for r in local))
        sigs = ctx.all_gather_object(sig)
        world_sig = _digest(sigs)
        if self._prepared is not None and self._prepared.signature == world_sig:
            return self._prepared
        records = [r for per_rank in ctx.mesh_gather_object(local) for r in per_rank]
        mapped = self.config.export.format != "paddle_safetensors"
        error, prepared = None, None
        try:
            validate_records(records)
            if ctx.mesh.size == 1:
                for r in records:
                    if r.shape != r.global_shape:
                        raise MappingError(
                            f"parameter {r.key!r} is a slice {list(r.shape)} of {list(r.global_shape)} on rank {r.rank}, "
                            "but the topology gives this rank a mesh of one: the parallel axes do not match the job"
                        )
            dmap = build_destination_map(shard_info_from_records(records), source.aoa_config if mapped else None)
            if source.check_names is not None:
                source.check_names(dmap.names)
            specs = apply_export_dtype(dmap.specs, self.config.export.dtype)
            plan = build_export_plan(specs, self.config.export.max_shard_bytes)
            order = [s.name for f in plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
            writes = plan_writes(ctx.topology, [f.total_bytes for f in plan.files])
            prepared = _Prepared(world_sig, records, dmap, plan, order, writes)
            plan_digest = _digest([(f.name, f.header) for f in plan.files])
        except Exception as e:  # reported on every rank below, never raised alone
            error, plan_digest = f"{type(e).__name__}: {e}", None
        # every rank must hold the same plan: a rank alone in a collective would hang
        outcomes = ctx.all_gather_object((error, plan_digest))
        errors = [e for e, _ in outcomes if e]
        if errors:
            raise ExportError(f"export planning failed: {errors[0]}")
        if len({d for _, d in outcomes}) != 1:
            raise ExportError(
                "ranks computed different export plans (their models differ in names, shapes or dtypes, "
                "or their configs differ); refusing to export"
            )
        self._prepared = prepared
        return prepared

    # ---- the export ----------------------------------------------------------------------
    def _stream(self, sd, p: _Prepared, source: ModelSource, targets: List[str], keep: set):
        ctx, cfg = self.ctx, self.config
        mapped = cfg.export.format != "paddle_safetensors"
        if cfg.assembler == "paddle":
            from ..assemble.paddle_ref import run_paddle_full_param

            if ctx.world_size == 1 or ctx.mesh.size > 1:
                # Paddle's HV path needs both groups (a one-rank group for a 1-D mesh); each mesh
                # assembles everything (Paddle splits by sorted names, not by our files) and keeps its own
                kwargs = {}
                if ctx.mesh.size > 1:
                    kwargs = {"h_group": getattr(ctx, "paddle_h_group", None) or ctx.h_group,
                              "v_group": getattr(ctx, "paddle_v_group", None) or ctx.v_group}
                for name, t in run_paddle_full_param(sd, source.aoa_config if mapped else None, cfg.export.dtype, **kwargs):
                    if name in keep:
                        yield name, t
                return
            # a mesh of one inside a multi-rank job: Paddle's full_param would take its
            # single-group path (it decides by the world size) and call .cuda(); assemble locally
            logger.warning("assembler=paddle: a mesh of one rank uses the builtin local assembler (no communication)")
        if ctx.mesh.size == 1:
            yield from LocalAssembler(sd, p.dmap, cfg.export.dtype).run([n for n in targets if n in keep])
            return
        asm = MeshAssembler(sd, p.records, p.dmap, targets, keep, ctx.mesh, ctx.rank, ctx.h_group, ctx.v_group,
                            cfg.export.dtype, cfg.topology.bucket_for(ctx.mesh.size))
        # replicas inside the mesh must agree before the lowest rank's copy stands for all
        held = ctx.mesh_gather_object(asm.replica_digests())
        merged: Dict[int, Dict[str, int]] = {}
        for r, digests in zip(ctx.mesh.ranks_in_gather_order(), held):
            for item_id, d in digests.items():
                merged.setdefault(item_id, {}).setdefault(d, r)
        for item_id, by_digest in sorted(merged.items()):
            if len(by_digest) > 1:
                it = asm.items[item_id]
                raise MappingError(
                    f"parameter {it.key!r}: ranks {sorted(by_digest.values())} hold the same slice at "
                    f"{list(it.offset)} with different values (replicas out of sync)"
                )
        yield from asm.run()
        if asm.errors:
            raise MappingError(asm.errors[0])

    def export(self, source: ModelSource, step: int, metrics: Optional[dict] = None, reason: str = "") -> SnapshotInfo:
        t0 = time.perf_counter()
        ctx, cfg = self.ctx, self.config
        name = format_snapshot_name(cfg.export.name_template, step)
        exporter: Exporter = make_exporter(cfg.export, self.fn, ctx)
        sd = source.sharded_state_dict()
        p = self.prepare(source, sd)
        mesh_files = p.writes.files_of_mesh(ctx.mesh.index)
        my_files = p.writes.files_of_rank(ctx.rank)
        if not exporter.writes_files:  # callable: the mesh's tensors go to fn on each rank of the mesh
            my_files = mesh_files
        targets = [n for n in p.order if p.plan.slots[n].file_index in set(mesh_files)]
        keep = {n for n in targets if p.plan.slots[n].file_index in set(my_files)}

        # the coordinator makes the staging directory and tells everyone its name
        staging, error = None, None
        if exporter.writes_files and ctx.is_coordinator:
            try:
                commit.check_output_dir(self.output_dir)
                staging = commit.new_staging_dir(self.output_dir, name)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        first = ctx.all_gather_object((str(staging) if staging else None, error))[ctx.coordinator]
        if first[1]:
            raise ExportError(f"export of step {step} to {self.output_dir / name} failed: {first[1]}")
        staging_path = Path(first[0]) if first[0] else None
        t_plan = time.perf_counter()

        # assemble and write; an error stops this rank's writing, never its part in the collectives
        error, files, seen = None, {}, 0
        try:
            exporter.begin(p.plan, staging_path, step, my_files)
            for tname, tensor in self._stream(sd, p, source, targets, keep):
                if error is None:
                    try:
                        exporter.write(tname, tensor)
                        seen += 1
                    except Exception as e:
                        error = f"{type(e).__name__}: {e}"
            t_stream = time.perf_counter()
            if error is None:
                files = exporter.finish()
                if seen != len(keep):
                    error = f"rank {ctx.rank} received {seen} of its {len(keep)} tensors"
        except Exception as e:
            error = error or f"{type(e).__name__}: {e}"
            t_stream = time.perf_counter()
        if error is not None:
            exporter.abort()
        t_written = time.perf_counter()
        statuses = ctx.all_gather_object((error, {k: (v.bytes, v.sha256) for k, v in files.items()}))
        errors = [(r, e) for r, (e, _) in enumerate(statuses) if e]
        if errors:
            if ctx.is_coordinator and staging_path is not None:
                shutil.rmtree(staging_path, ignore_errors=True)
            r, e = errors[0]
            where = f" (rank {r})" if ctx.world_size > 1 else ""
            raise ExportError(f"export of step {step} to {self.output_dir / name} failed{where}: {e}")
        all_files = {k: v for _, fs in statuses for k, v in fs.items()}
        timings = {"plan_s": t_plan - t0, "assemble_write_s": t_stream - t_plan, "flush_s": t_written - t_stream}
        if not exporter.writes_files:
            return SnapshotInfo(name, step, None, 0, 0, p.plan.num_tensors, time.perf_counter() - t0, timings, reason)

        # the coordinator commits; everyone learns the outcome
        error, final = None, self.output_dir / name
        if ctx.is_coordinator:
            try:
                self._commit(staging_path, name, step, reason, metrics, p, all_files, timings, source)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                shutil.rmtree(staging_path, ignore_errors=True)
        outcome = ctx.all_gather_object(error)[ctx.coordinator]
        if outcome:
            raise ExportError(f"export of step {step} to {final} failed while committing: {outcome}")
        total = time.perf_counter() - t0
        timings["commit_s"] = total - (t_written - t0)
        timings["total_s"] = total
        shard_bytes = sum(b for f, (b, _) in all_files.items())
        info = SnapshotInfo(name, step, final, len(all_files), shard_bytes, p.plan.num_tensors, total, timings, reason,
                            getattr(exporter, "peak_pending_bytes", 0), len(files))
        if ctx.is_coordinator:
            logger.info(
                "snapshot %s (step %d, %s): %d files, %.1f MB in %.2f s (%.2f GB/s)",
                name, step, reason or "export", info.files, info.bytes / 1e6, total, info.bytes / 1e9 / max(total, 1e-9),
            )
        return info

    def _commit(self, staging: Path, name, step, reason, metrics, p: _Prepared, files, timings, source) -> None:
        extra = self._write_side_files(staging, source, p.plan)
        topo = self.ctx.topology
        manifest = build_manifest(
            name=name, step=step, reason=reason, metrics=metrics, config=self.config, plan=p.plan,
            files={**files, **extra}, timings=timings, framework=source.framework,
            topology={
                "world_size": topo.world_size, "axes": [list(a) for a in topo.axes],
                "sharding_stage": topo.sharding_stage, "meshes": [[list(r) for r in m.rows] for m in topo.meshes],
                "writers": {str(r): fs for r, fs in sorted(p.writes.writers().items())},
                "assembler": self.config.assembler,
            },
        )
        commit.write_json_durable(staging / commit.MANIFEST, manifest)
        commit.commit_staging(staging, self.output_dir, name)
        commit.write_pointer(self.output_dir, "latest", name)
        removed = commit.apply_retention(self.output_dir, self.pattern, self.config.retention.keep_last, protect=[name])
        if removed:
            logger.info("retention (keep_last=%d) removed %s", self.config.retention.keep_last, removed)

    def _write_side_files(self, staging: Path, source: ModelSource, plan: ExportPlan) -> Dict[str, tuple]:
        """Index, config.json, generation_config.json, tokenizer files -> {file: (bytes, sha256)}."""
        written = []
        commit.write_json_durable(staging / commit.INDEX, plan.index())
        written.append(commit.INDEX)
        if self.config.export.format == "hf_safetensors":
            if source.hf_config is not None:
                cfg = dict(source.hf_config)
                dtype = dominant_float_dtype(plan)
                if dtype:
                    cfg["torch_dtype"] = dtype
                    cfg["dtype"] = dtype
                commit.write_json_durable(staging / "config.json", cfg)
                written.append("config.json")
            if source.generation_config:
                commit.write_json_durable(staging / "generation_config.json", source.generation_config)
                written.append("generation_config.json")
            if self.config.export.copy_tokenizer and source.tokenizer is not None:
                before = {q.name for q in staging.iterdir()}
                source.tokenizer.save_pretrained(str(staging))
                written.extend(sorted({q.name for q in staging.iterdir() if q.is_file()} - before))
        return describe_files(staging, written)
