"""One export, end to end: plan (cached), assemble, write, commit, point ``latest``, retain.

The same flow serves one process and many ranks (``ctx``: see ``distributed.py``):

1. metadata: the mesh's shard records (one exchange, the first time), checked for consistency;
2. mapping and plans: destination tensors, shard files, the split of files across meshes and
   writers; every rank must compute the same export plan (checked by a digest exchange);
3. the coordinator creates the staging directory and tells everyone its name;
4. each mesh assembles its split; each rank writes only its own files, all at the same time;
5. status exchange: every rank learns whether every rank succeeded, and the per-file sizes and
   checksum; on any failure everyone raises the same error and the coordinator removes staging;
6. the coordinator writes index, config, tokenizer, manifest (last), renames, updates
   ``latest`` and retention; a last exchange tells everyone the outcome.

Everything that can be checked is checked before the first byte. A failure after that removes
the staging directory: nothing half-written stays visible.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..assemble.local import LocalAssembler
from ..assemble.mapping import (
    DestinationMap, MappingError, apply_export_dtype, build_destination_map, padding_destinations,
)
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
from .. import _faults
from . import commit
from .distributed import LocalContext
from .exporters import Exporter, load_callable, make_exporter
from .lock import release_on_signals
from .ownership import read_manifest
from .retention import apply_retention, newest_run, next_seq, update_best
from .watchdog import PROGRESS_DIR, Watchdog
from .host import with_zero_row
from .manifest import build_manifest, clean_metrics, describe_files, dominant_float_dtype

logger = logging.getLogger("paddle_fullparam_callbacks")


class ExportError(RuntimeError):
    """An export failed; nothing of it was committed."""


@dataclass
class ModelSource:
    """What the export needs from the model, gathered by the integrations layer."""

    sharded_state_dict: Callable[[], dict]
    aoa_config: Optional[dict] = None
    # when the mapping depends on the whole model (a pipeline stage sees only its layers): called
    # with every mesh rank's source names and global shapes, it returns the aoa config to use
    mapping_for: Optional[Callable[[Dict[str, tuple]], Optional[dict]]] = None
    hf_config: Optional[dict] = None
    generation_config: Optional[dict] = None
    tokenizer: Any = None
    framework: str = "paddle"
    check_mapping: Optional[Callable] = None  # called with the DestinationMap of a new mapping; raises to refuse
    padding_rows: Dict[str, int] = field(default_factory=dict)  # source key -> embedding row exported as zeros
    notes: Dict[str, Any] = field(default_factory=dict)  # recorded in the manifest under "model"


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
    pending: bool = False  # async_write: assembled, not yet committed
    stall_s: float = 0.0  # how long training waited for this export


@dataclass
class _Prepared:
    signature: str
    records: list
    dmap: DestinationMap
    plan: ExportPlan
    order: List[str]  # destination names in file order
    writes: WritePlan
    zero_rows: Dict[str, int] = field(default_factory=dict)  # destination -> row written as zeros


@dataclass
class _Job:
    """One export in flight, between assembly and commit."""

    name: str
    step: int
    reason: str
    metrics: Optional[dict]
    p: "_Prepared"
    staging: Optional[Path]
    exporter: Exporter
    source: ModelSource
    expected: int
    t0: float
    t_plan: float
    t_stream: float = 0.0
    t_written: float = 0.0
    seen: int = 0
    error: Optional[str] = None
    files: dict = field(default_factory=dict)
    thread: Optional[threading.Thread] = None
    info: Optional[SnapshotInfo] = None
    exception: Optional[BaseException] = None
    out_dir: Optional[Path] = None
    stall_s: float = 0.0
    pointers: bool = True  # update latest/best and apply retention after the commit


class _NoProgress:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(show: bool, total: int, name: str):
    """A tqdm bar on the coordinator, shown only when the export takes more than 2 seconds."""
    if not show:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"export {name}", delay=2.0, leave=False)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


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
        self._pending: Optional[_Job] = None
        self._atexit_registered = False
        self._ring = None
        self._lock = None
        self._created_dir = False
        self.is_open = False  # between start() and close()
        self.pattern = snapshot_step_pattern(config.export.name_template)
        self.run_id, self._seq = new_run_id(), 1  # settled by start()

    def start(self, resume: bool = False) -> List[str]:
        """Check output_dir, take its lock, remove leftovers of interrupted exports that are provably
        this package's, and settle this job's run (coordinator); all ranks call it.

        ``resume``: the trainer resumed from a checkpoint; the job continues the run of the newest
        snapshot here (re-exporting its steps replaces them). Otherwise it is a new run, which never
        replaces or deletes another run's snapshots (unless ``retention.other_runs: delete``).
        """
        removed: List[str] = []
        error, run = None, (new_run_id(), 1)
        if self.config.export.format == "callable" and self.fn is None:
            self.fn = load_callable(self.config.export.callable)  # every rank: a ConfigError now, not at the first export
        if self.ctx.is_coordinator and self.config.export.format != "callable":
            try:
                self._created_dir = not self.output_dir.exists()
                commit.check_output_dir(self.output_dir)
                commit.check_pointers(self.output_dir)
                # one job per output_dir: only then are leftovers surely ours to remove
                self._lock = commit.acquire_lock(self.output_dir, owner="another export session", holder=self)
                release_on_signals(self._lock)
                atexit.register(self._lock.release)
                removed, _ = commit.cleanup_stale(self.output_dir)
                run_id = (newest_run(self.output_dir, self.pattern) if resume else None) or run[0]
                run = (run_id, next_seq(self.output_dir, self.pattern, run_id))
            except (OSError, commit.OutputDirLocked) as e:
                error = (type(e).__name__, str(e))
        gathered = self.ctx.all_gather_object((error, run))
        errors = [e for e, _ in gathered if e]
        if errors:
            kind, message = errors[0]
            raise (commit.OutputDirLocked if kind == "OutputDirLocked" else OSError)(message)
        self.run_id, self._seq = gathered[self.ctx.coordinator][1]
        self._start_watchdog()
        self.is_open = True
        if self.ctx.is_coordinator and self.config.export.format != "callable":
            logger.info("full-parameter snapshots go to %s (run %s)", self.output_dir, self.run_id)
        if removed:
            logger.info("removed %d leftover(s) of interrupted exports in %s: %s", len(removed), self.output_dir, removed)
        return removed

    def _start_watchdog(self) -> None:
        """export.timeout_s, with several ranks: every collective of the package is watched."""
        timeout = self.config.export.timeout_s
        if self.ctx.world_size <= 1 or not timeout or self.ctx.watchdog is not None:
            return
        progress = self.output_dir / PROGRESS_DIR
        try:
            progress.mkdir(exist_ok=True)
        except OSError:
            progress = None  # the culprit will not be named; the timeout still holds
        lock = self._lock
        self.ctx.watchdog = Watchdog(timeout, self.ctx.rank, list(range(self.ctx.world_size)), progress,
                                     on_expire=lock.release if lock is not None else None)

    def close(self) -> None:
        """Finish a pending background export and release the output directory (also done at exit)."""
        self.wait_pending()
        self.is_open = False
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.close()
            self.ctx.watchdog = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
            self._remove_if_unused()

    def _remove_if_unused(self) -> None:
        """An output_dir this job created and never exported into (e.g. the checkpoint hook wrote every
        snapshot into the trainer's checkpoints) is removed again, with the package's own entries."""
        if not self._created_dir:
            return
        try:
            entries = {p.name for p in self.output_dir.iterdir()}
            if entries - {PROGRESS_DIR}:
                return
            if PROGRESS_DIR in entries:
                shutil.rmtree(self.output_dir / PROGRESS_DIR, ignore_errors=True)
            self.output_dir.rmdir()
        except OSError:
            pass  # another process wrote into it meanwhile: it stays

    def _check_target(self, final: Path) -> None:
        """What is at a snapshot's name may be replaced only if it is this run's snapshot."""
        if not (final.exists() or final.is_symlink()):
            return
        manifest = None if final.is_symlink() else read_manifest(final)
        if manifest is None:
            raise FileExistsError(
                f"{str(final)!r} exists and is not a snapshot of this package; refusing to replace it (nothing of it "
                "was touched). Move it away, or choose another export.name_template or output_dir")
        run = manifest.get("run") if isinstance(manifest.get("run"), dict) else {}
        if run.get("id") != self.run_id and self.config.retention.other_runs != "delete":
            raise FileExistsError(
                f"{str(final)!r} holds a snapshot of another run (run {run.get('id')}, step {manifest.get('step')}); "
                "this run does not replace it. Use another output_dir, put a run name into export.name_template, "
                "or set retention.other_runs=delete")

    # ---- planning ----------------------------------------------------------------------
    def prepare(self, source: ModelSource, sharded_state_dict: Optional[dict] = None) -> _Prepared:
        """Mapping and plans; recomputed only when some rank's parameter names, shapes or dtypes change.

        A collective on every rank (cheap when nothing changed: one digest exchange).
        """
        ctx = self.ctx
        _faults.point("plan")
        sd = source.sharded_state_dict() if sharded_state_dict is None else sharded_state_dict
        local = records_from_state_dict(ctx.rank, sd)
        sig = _digest(sorted((r.key, r.offset, r.shape, r.global_shape, r.dtype) for r in local))
        sigs = ctx.all_gather_object(sig, what="plan: parameter signatures")
        world_sig = _digest(sigs)
        if self._prepared is not None and self._prepared.signature == world_sig:
            return self._prepared
        # with each rank's records, its padding rows: the pipeline stage holding the embedding tells the writer
        flat = sorted(k for k, sw in sd.items() if getattr(sw, "is_flattened", False))
        gathered = ctx.mesh_gather_object((local, source.padding_rows, flat), "plan: shard records")
        records = [r for per_rank, _, _ in gathered for r in per_rank]
        padding_rows = {k: v for _, rows, _ in gathered for k, v in rows.items()}
        flattened = sorted({k for _, _, keys in gathered for k in keys})
        mapped = self.config.export.format != "paddle_safetensors"
        error, prepared = None, None
        try:
            if flattened:
                more = f" and {len(flattened) - 3} more" if len(flattened) > 3 else ""
                raise MappingError(
                    f"parameter(s) {flattened[:3]}{more} are flattened shards (is_flattened: sharding stage 1 v2 "
                    "or stage 3 with tensor fusion): the exporter needs every rank's block of each tensor (its global "
                    "offset and shape); export from a job without tensor fusion, or convert its saved checkpoint")
            validate_records(records)
            if ctx.mesh.size == 1:
                for r in records:
                    if r.shape != r.global_shape:
                        raise MappingError(
                            f"parameter {r.key!r} is a slice {list(r.shape)} of {list(r.global_shape)} on rank {r.rank}, "
                            "but the topology gives this rank a mesh of one: the parallel axes do not match the job"
                        )
            if mapped and source.mapping_for is not None:
                source.aoa_config = source.mapping_for({r.key: tuple(r.global_shape) for r in records})
            dmap = build_destination_map(shard_info_from_records(records), source.aoa_config if mapped else None)
            if source.check_mapping is not None:
                source.check_mapping(dmap)
            zero_rows = padding_destinations(dmap, padding_rows)
            specs = apply_export_dtype(dmap.specs, self.config.export.dtype)
            plan = build_export_plan(specs, self.config.export.max_shard_bytes)
            order = [s.name for f in plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
            writes = plan_writes(ctx.topology, [f.total_bytes for f in plan.files])
            prepared = _Prepared(world_sig, records, dmap, plan, order, writes, zero_rows)
            plan_digest = _digest([(f.name, f.header) for f in plan.files])
        except Exception as e:  # reported on every rank below, never raised alone
            error, plan_digest = f"{type(e).__name__}: {e}", None
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
        self._prepared = prepared
        if self.config.export.async_write and self._ring is None and self._pending is None:
            self._host_ring()  # allocate and touch the staging memory now, not during the first export
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
        held = ctx.mesh_gather_object(asm.replica_digests(), "assembly: replica digests")
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

    def export(self, source: ModelSource, step: int, metrics: Optional[dict] = None, reason: str = "",
               into: Optional[Path] = None, name: Optional[str] = None) -> SnapshotInfo:
        """Export ``step``. Collective: every rank calls it. With ``export.async_write`` it returns
        once the tensors are assembled (``info.pending``); the next export or :meth:`wait_pending`
        finishes the commit.

        ``into``/``name``: commit the snapshot as ``into/name`` (e.g. inside a trainer checkpoint)
        instead of ``output_dir/<name_template>``; no pointer or retention is touched then.
        """
        t0 = time.perf_counter()
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.step = step
        self.wait_pending()
        ctx, cfg = self.ctx, self.config
        out_dir = Path(into) if into is not None else self.output_dir
        name = name or format_snapshot_name(cfg.export.name_template, step)
        try:
            exporter: Exporter = make_exporter(cfg.export, self.fn, self._host_ring())
            sd = source.sharded_state_dict()
        except Exception as e:  # the same on every rank, before any collective: through on_error
            raise ExportError(f"export of step {step} failed before it started: {type(e).__name__}: {e}") from e
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
                commit.check_output_dir(out_dir)
                self._check_target(out_dir / name)
                staging = commit.new_staging_dir(out_dir, name, self.run_id)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        first = ctx.all_gather_object((str(staging) if staging else None, error), what="staging")[ctx.coordinator]
        if first[1]:
            raise ExportError(f"export of step {step} to {out_dir / name} failed: {first[1]}")
        _faults.point("staging")
        job = _Job(name, step, reason, metrics, p, Path(first[0]) if first[0] else None, exporter, source,
                   len(keep), t0, time.perf_counter(), out_dir=out_dir, pointers=into is None)

        # assemble and write; an error stops this rank's writing, never its part in the collectives
        progress = _progress(ctx.is_coordinator, sum(p.plan.slots[n].nbytes for n in keep), name)
        beat = ctx.watchdog.beat if ctx.watchdog is not None else (lambda: None)
        try:
            exporter.begin(p.plan, job.staging, step, my_files)
            with ctx.waiting("assembly", ctx.mesh_ranks):  # export.timeout_s: no tensor for that long ends the job
                for tname, tensor in self._stream(sd, p, source, targets, keep):
                    beat()
                    if job.error is None:
                        try:
                            if tname in p.zero_rows:
                                tensor = with_zero_row(tensor, p.zero_rows[tname])
                            exporter.write(tname, tensor)
                            job.seen += 1
                            _faults.point("tensor")
                            progress.update(p.plan.slots[tname].nbytes)
                        except Exception as e:
                            job.error = f"{type(e).__name__}: {e}"
        except Exception as e:
            job.error = job.error or f"{type(e).__name__}: {e}"
        finally:
            progress.close()
        job.t_stream = time.perf_counter()
        if cfg.export.async_write and exporter.writes_files and job.error is None:
            # training resumes now; the writer drains in the background (and, single-process,
            # commits there too; with several ranks the commit needs collectives, so the next
            # export / wait_pending() does it on the training thread)
            job.thread = threading.Thread(target=self._background, args=(job,), name="pfc-commit", daemon=True)
            job.thread.start()
            self._pending = job
            if not self._atexit_registered:
                atexit.register(self._wait_at_exit)
                self._atexit_registered = True
            stall = job.stall_s = time.perf_counter() - t0
            return SnapshotInfo(name, step, out_dir / name, 0, 0, p.plan.num_tensors, stall,
                                {"stall_s": stall}, reason, pending=True, stall_s=stall)
        self._finish_local(job)
        return self._finish_global(job)

    def _host_ring(self):
        """Host memory reused by every background export (pre-faulted once): see HostRing.

        ``export.max_pending_bytes``, or less when this rank's files are smaller."""
        if not self.config.export.async_write or self.config.export.format == "callable":
            return None
        if self._ring is None:
            from .host import HostRing

            size = self.config.export.max_pending
            if self._prepared is not None:
                p = self._prepared
                mine = sum(p.plan.files[i].data_bytes for i in p.writes.files_of_rank(self.ctx.rank))
                size = max(1, min(size, mine))
            self._ring = HostRing(size)
        self._ring.reset()  # the previous export has finished (wait_pending ran first)
        return self._ring

    def wait_pending(self) -> Optional[SnapshotInfo]:
        """Finish a background (async_write) export: wait for its bytes, commit, report errors.

        Collective with several ranks. Returns its SnapshotInfo, or None if nothing was pending.
        """
        job, self._pending = self._pending, None
        if job is None:
            return None
        job.thread.join()
        if self.ctx.world_size > 1:
            return self._finish_global(job)
        if job.exception is not None:
            raise job.exception
        return job.info

    def annotate(self, step: int, metrics: dict) -> None:
        """Add evaluation metrics to the committed snapshot of ``step`` (the manifest is replaced
        atomically), then refresh ``best`` and retention. Every rank calls it; the coordinator acts."""
        self.wait_pending()
        name = format_snapshot_name(self.config.export.name_template, step)
        path = self.output_dir / name / commit.MANIFEST
        if not self.ctx.is_coordinator or not path.is_file():
            return
        manifest = json.loads(path.read_text())
        manifest["metrics"] = {**(manifest.get("metrics") or {}), **clean_metrics(metrics)}
        tmp = path.with_name(f".{commit.MANIFEST}.tmp")
        _faults.point("annotate")
        commit.write_json_durable(tmp, manifest)
        os.replace(tmp, path)
        commit.fsync_dir(path.parent)
        self._after_commit(name)

    def _wait_at_exit(self) -> None:
        """Interpreter exit: a single-process background commit is finished, not lost.

        (With several ranks the commit needs collectives, which cannot run at exit; the trainer's
        on_train_end finishes it. A job killed before that leaves only its .tmp-* directory.)"""
        if self._pending is None:
            return
        if self.ctx.world_size > 1:
            logger.warning("exiting with the background export of %s uncommitted (several ranks: it needs the "
                           "next trainer event); only its staging directory remains", self._pending.name)
            return
        try:
            self.wait_pending()
        except Exception as e:  # at exit: report, never raise
            logger.error("the background export failed at exit: %s", e)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def _background(self, job: "_Job") -> None:
        self._finish_local(job)
        if self.ctx.world_size == 1:
            try:
                job.info = self._finish_global(job)
            except BaseException as e:  # handed to wait_pending
                job.exception = e

    def _finish_local(self, job: "_Job") -> None:
        """This rank's files: wait for the writer, fsync, sizes and checksums (or abort on error)."""
        if job.error is None:
            try:
                _faults.point("finish")
                job.files = job.exporter.finish()
                if job.seen != job.expected:
                    job.error = f"rank {self.ctx.rank} received {job.seen} of its {job.expected} tensors"
            except Exception as e:
                job.error = f"{type(e).__name__}: {e}"
        if job.error is not None:
            job.exporter.abort()
        job.t_written = time.perf_counter()

    def _finish_global(self, job: "_Job") -> SnapshotInfo:
        """Status exchange, then the coordinator commits and everyone learns the outcome."""
        ctx, name, step = self.ctx, job.name, job.step
        statuses = ctx.all_gather_object((job.error, {k: (v.bytes, v.digest) for k, v in job.files.items()}),
                                         what="status exchange")
        errors = [(r, e) for r, (e, _) in enumerate(statuses) if e]
        if errors:
            if ctx.is_coordinator and job.staging is not None:
                shutil.rmtree(job.staging, ignore_errors=True)
            r, e = errors[0]
            where = f" (rank {r})" if ctx.world_size > 1 else ""
            raise ExportError(f"export of step {step} to {job.out_dir / name} failed{where}: {e}")
        all_files = {k: v for _, fs in statuses for k, v in fs.items()}
        timings = {"plan_s": job.t_plan - job.t0, "assemble_write_s": job.t_stream - job.t_plan,
                   "flush_s": job.t_written - job.t_stream}
        if job.thread is not None:  # async_write: how long training waited (the rest ran in the background)
            timings["stall_s"] = job.stall_s
        if not job.exporter.writes_files:
            total = time.perf_counter() - job.t0
            return SnapshotInfo(name, step, None, 0, 0, job.p.plan.num_tensors, total, timings, job.reason, stall_s=total)
        error, final = None, job.out_dir / name
        if ctx.is_coordinator:
            try:
                self._commit(job, all_files, timings)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                shutil.rmtree(job.staging, ignore_errors=True)
        outcome = ctx.all_gather_object(error, what="commit outcome")[ctx.coordinator]
        if outcome:
            raise ExportError(f"export of step {step} to {final} failed while committing: {outcome}")
        total = time.perf_counter() - job.t0
        timings["commit_s"] = total - (job.t_written - job.t0)
        timings["total_s"] = total
        shard_bytes = sum(b for b, _ in all_files.values())
        stall = job.stall_s if job.thread is not None else total
        info = SnapshotInfo(name, step, final, len(all_files), shard_bytes, job.p.plan.num_tensors, total, timings,
                            job.reason, getattr(job.exporter, "peak_pending_bytes", 0), len(job.files), stall_s=stall)
        if ctx.is_coordinator:
            logger.info(
                "snapshot %s (step %d, %s): %d files, %.1f MB in %.2f s (%.2f GB/s), training stalled %.2f s",
                name if job.pointers else f"{job.out_dir.name}/{name}", step, job.reason or "export", info.files,
                info.bytes / 1e6, total,
                info.bytes / 1e9 / max(total, 1e-9), stall,
            )
        return info

    def _commit(self, job: "_Job", files, timings) -> None:
        staging, name, p, source = job.staging, job.name, job.p, job.source
        _faults.point("side_files")
        extra = self._write_side_files(staging, source, p.plan)
        topo = self.ctx.topology
        manifest = build_manifest(
            name=name, step=job.step, reason=job.reason, metrics=job.metrics, config=self.config, plan=p.plan,
            files={**files, **extra}, timings=timings, framework=source.framework,
            model={**source.notes, **({"padding_rows_zeroed": p.zero_rows} if p.zero_rows else {})},
            run={"id": self.run_id, "seq": self._seq},
            topology={
                "world_size": topo.world_size, "axes": [list(a) for a in topo.axes],
                "sharding_stage": topo.sharding_stage, "meshes": [[list(r) for r in m.rows] for m in topo.meshes],
                "writers": {str(r): fs for r, fs in sorted(p.writes.writers().items())},
                "assembler": self.config.assembler,
            },
        )
        _faults.point("manifest")
        commit.write_json_durable(staging / commit.MANIFEST, manifest)
        _faults.point("rename")
        commit.commit_staging(staging, job.out_dir, name)
        self._seq += 1
        _faults.point("latest")
        if not job.pointers:
            return
        commit.write_pointer(self.output_dir, "latest", name)
        self._after_commit(name)

    def _after_commit(self, name: str) -> None:
        """Point ``best`` at the best snapshot by the tracked metric, then apply retention."""
        ret = self.config.retention
        _faults.point("best")
        update_best(self.output_dir, self.pattern, ret.metric, ret.mode, self.run_id, ret.other_runs)
        _faults.point("retention")
        removed = apply_retention(self.output_dir, self.pattern, ret.keep_last, protect=[name], keep_best=ret.keep_best,
                                  metric=ret.metric, mode=ret.mode, run_id=self.run_id, other_runs=ret.other_runs)
        if removed:
            logger.info("retention (keep_last=%d, keep_best=%d) removed %s", ret.keep_last, ret.keep_best, removed)

    def _write_side_files(self, staging: Path, source: ModelSource, plan: ExportPlan) -> Dict[str, tuple]:
        """Index, config.json, generation_config.json, tokenizer files -> {file: (bytes, digest)}."""
        written = []
        if plan.needs_index:
            commit.write_json_durable(staging / commit.INDEX, plan.index())
            written.append(commit.INDEX)
        if self.config.export.format == "hf_safetensors":
            if source.hf_config is not None:
                cfg = dict(source.hf_config)
                dtype = dominant_float_dtype(plan)
                if dtype:
                    cfg["dtype"] = dtype  # transformers >= 4.56 writes and reads this key (torch_dtype before)
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
