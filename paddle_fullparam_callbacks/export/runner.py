"""One export, end to end: plan (cached), assemble, write, commit, point ``latest``, retain.

Everything that can be checked is checked before the first byte: the output directory, the
snapshot name, the mapping (every destination filled exactly once) and the plan. A failure
after that aborts the writers and removes the staging directory: nothing half-written stays
visible.
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from .. import _dtypes
from ..assemble.local import LocalAssembler
from ..assemble.mapping import (
    DestinationMap,
    apply_export_dtype,
    build_destination_map,
    local_shard_info,
    source_signature,
)
from ..config.schema import FullParamConfig
from ..plan.export_plan import ExportPlan, build_export_plan
from ..plan.naming import format_snapshot_name, snapshot_step_pattern
from . import commit
from .exporters import Exporter, make_exporter
from .manifest import build_manifest, dominant_float_dtype

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


@dataclass
class _Prepared:
    signature: tuple
    dmap: DestinationMap
    plan: ExportPlan
    order: List[str]


class ExportSession:
    """Holds what stays the same across a job's exports (the mapping and the plan)."""

    def __init__(self, config: FullParamConfig, output_dir: "str | Path", fn: Optional[Callable] = None):
        self.config = config
        self.output_dir = Path(output_dir)
        self.fn = fn
        self._prepared: Optional[_Prepared] = None
        self.pattern = snapshot_step_pattern(config.export.name_template)

    def start(self) -> List[str]:
        """Check output_dir and remove leftovers of interrupted exports; call once per job."""
        commit.check_output_dir(self.output_dir)
        removed = commit.cleanup_stale(self.output_dir)
        if removed:
            logger.info("removed %d leftover(s) of interrupted exports in %s: %s", len(removed), self.output_dir, removed)
        return removed

    # ---- planning ----------------------------------------------------------------------
    def prepare(self, source: ModelSource, sharded_state_dict: Optional[dict] = None) -> _Prepared:
        """Mapping and plan; recomputed only when source names, shapes or dtypes change."""
        sd = source.sharded_state_dict() if sharded_state_dict is None else sharded_state_dict
        info = local_shard_info(sd)
        sig = source_signature(info)
        if self._prepared is not None and self._prepared.signature == sig:
            return self._prepared
        exporter_maps = self.config.export.format != "paddle_safetensors"
        dmap = build_destination_map(info, source.aoa_config if exporter_maps else None)
        if source.check_names is not None:
            source.check_names(dmap.names)
        specs = apply_export_dtype(dmap.specs, self.config.export.dtype)
        plan = build_export_plan(specs, self.config.export.max_shard_bytes)
        order = [s.name for f in plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
        self._prepared = _Prepared(sig, dmap, plan, order)
        return self._prepared

    def _stream(self, sd, prepared: _Prepared, aoa_config):
        if self.config.assembler == "paddle":
            from ..assemble.paddle_ref import run_paddle_full_param

            mapped = aoa_config if self.config.export.format != "paddle_safetensors" else None
            return run_paddle_full_param(sd, mapped, self.config.export.dtype)
        return LocalAssembler(sd, prepared.dmap, self.config.export.dtype).run(prepared.order)

    # ---- the export ----------------------------------------------------------------------
    def export(self, source: ModelSource, step: int, metrics: Optional[dict] = None, reason: str = "") -> SnapshotInfo:
        t0 = time.perf_counter()
        cfg = self.config
        name = format_snapshot_name(cfg.export.name_template, step)
        exporter: Exporter = make_exporter(cfg.export, self.fn)
        sd = source.sharded_state_dict()
        prepared = self.prepare(source, sd)
        plan = prepared.plan
        staging = None
        if exporter.writes_files:
            commit.check_output_dir(self.output_dir)
            staging = commit.new_staging_dir(self.output_dir, name)
        t_plan = time.perf_counter()
        try:
            exporter.begin(plan, staging, step)
            seen = 0
            for tname, tensor in self._stream(sd, prepared, source.aoa_config):
                if tname not in plan.slots:
                    raise ExportError(f"the assembler produced {tname!r}, which is not in the export plan")
                exporter.write(tname, tensor)
                seen += 1
            t_stream = time.perf_counter()
            files = exporter.finish()
            t_written = time.perf_counter()
            if seen != plan.num_tensors:
                raise ExportError(f"the assembler produced {seen} tensors, the plan has {plan.num_tensors}")
            if not exporter.writes_files:
                return SnapshotInfo(name, step, None, 0, 0, plan.num_tensors, time.perf_counter() - t0, reason=reason)
            extra = self._write_side_files(staging, source, plan)
            timings = {
                "plan_s": t_plan - t0,
                "assemble_write_s": t_stream - t_plan,
                "flush_s": t_written - t_stream,
            }
            manifest = build_manifest(
                name=name, step=step, reason=reason, metrics=metrics, config=cfg, plan=plan,
                files={**{k: (v.bytes, v.sha256) for k, v in files.items()}, **extra},
                timings=timings, framework=source.framework,
            )
            commit.write_json_durable(staging / commit.MANIFEST, manifest)
            final = commit.commit_staging(staging, self.output_dir, name)
            staging = None
            commit.write_pointer(self.output_dir, "latest", name)
            removed = commit.apply_retention(self.output_dir, self.pattern, cfg.retention.keep_last, protect=[name])
            if removed:
                logger.info("retention (keep_last=%d) removed %s", cfg.retention.keep_last, removed)
        except BaseException as e:
            exporter.abort()
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, (ExportError, KeyboardInterrupt, SystemExit)):
                raise
            raise ExportError(f"export of step {step} to {self.output_dir / name} failed: {e}") from e
        total = time.perf_counter() - t0
        timings["commit_s"] = total - (t_written - t0)
        timings["total_s"] = total
        info = SnapshotInfo(
            name, step, final, len(files), sum(v.bytes for v in files.values()), plan.num_tensors, total,
            timings, reason, getattr(exporter, "peak_pending_bytes", 0),
        )
        logger.info(
            "snapshot %s (step %d, %s): %d files, %.1f MB in %.2f s (%.2f GB/s)",
            name, step, reason or "export", info.files, info.bytes / 1e6, total, info.bytes / 1e9 / max(total, 1e-9),
        )
        return info

    def _write_side_files(self, staging: Path, source: ModelSource, plan: ExportPlan) -> Dict[str, tuple]:
        """Index, config.json, generation_config.json, tokenizer files -> {file: (bytes, sha256)}."""
        from .manifest import describe_files

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
                before = {p.name for p in staging.iterdir()}
                source.tokenizer.save_pretrained(str(staging))
                written.extend(sorted({p.name for p in staging.iterdir() if p.is_file()} - before))
        return describe_files(staging, written)
