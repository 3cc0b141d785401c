"""After the tensors: this rank's files finished, every rank's status exchanged, the commit.

``finish_local`` waits for this rank's writer (fsync, sizes, checksums) or aborts it;
``Committer.finish_global`` exchanges every rank's outcome, and the coordinator writes the side
files (index, config, tokenizer) and the manifest (last), renames staging into place, points
``latest`` and ``best`` and applies retention. Any failure removes the staging directory and
becomes the same ``ExportError`` on every rank.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

from ... import _faults
from ...config.schema import FullParamConfig
from ...plan.export_plan import ExportPlan
from .. import commit
from ..commit.manifest import build_manifest, describe_files, dominant_float_dtype
from ..write import checksum
from ..commit.ownership import read_manifest
from ..commit.retention import apply_retention, update_best
from ..source import ExportError, ModelSource, SnapshotInfo
from .exporters import Exporter
from .planning import PreparedExport

logger = logging.getLogger("paddle_fullparam_callbacks")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class ExportJob:
    """One export in flight, between assembly and commit."""

    name: str
    step: int
    reason: str
    metrics: Optional[dict]
    p: PreparedExport
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
    files: dict = field(default_factory=dict)  # file name -> FileResult (bytes, digest)
    thread: Optional[threading.Thread] = None
    info: Optional[SnapshotInfo] = None
    exception: Optional[BaseException] = None
    out_dir: Optional[Path] = None
    stall_s: float = 0.0
    pointers: bool = True  # update latest/best and apply retention after the commit
    companions: dict = field(default_factory=dict)  # the coordinator's: directory -> {file: (bytes, digest)}
    device: Any = None  # the DeviceBoundary of this export (what left the device, how long it took)
    traffic: dict = field(default_factory=dict)  # what this rank's assembler sent and received (bytes)
    traffic_by_rank: dict = field(default_factory=dict)  # every rank's, after the status exchange


def traffic_record(by_rank: dict, schedule: str) -> dict:
    """The manifest's ``traffic``: what each rank's assembler sent and received (bytes), and the totals."""
    if not by_rank:
        return {}
    keys = ("sent", "received", "sent_cross_node", "received_cross_node")
    totals = {k: sum(int(t.get(k, 0)) for t in by_rank.values()) for k in keys if any(k in t for t in by_rank.values())}
    return {"schedule": schedule, "total": totals,
            "per_rank": {str(r): {k: (round(v, 6) if isinstance(v, float) else v) for k, v in sorted(t.items())}
                         for r, t in sorted(by_rank.items())}}


def traffic_line(by_rank: dict, snapshot_bytes: int) -> str:
    """', moved 12.3 MB between ranks (0.50x the snapshot; most into a rank 3.1 MB), 0.0 MB across nodes'."""
    if not by_rank:
        return ""
    received = [int(t.get("received", 0)) for t in by_rank.values()]
    cross = sum(int(t.get("received_cross_node", 0)) for t in by_rank.values())
    share = sum(received) / snapshot_bytes if snapshot_bytes else 0.0
    line = (f", moved {sum(received) / 1e6:.1f} MB between ranks ({share:.2f}x the snapshot; most into a rank "
            f"{max(received) / 1e6:.1f} MB)")
    if any("received_cross_node" in t for t in by_rank.values()):
        line += f", {cross / 1e6:.1f} MB across nodes"
    return line


def finish_local(job: ExportJob, rank: int) -> None:
    """This rank's files: wait for the writer, fsync, sizes and checksums (or abort on error)."""
    if job.error is None:
        try:
            _faults.point("finish")
            job.files = job.exporter.finish()
            if job.seen != job.expected:
                job.error = f"rank {rank} received {job.seen} of its {job.expected} tensors"
        except Exception as e:
            job.error = f"{type(e).__name__}: {e}"
    if job.error is not None:
        job.exporter.abort()
    job.t_written = time.perf_counter()


def _companion_table(companions: dict) -> dict:
    """The manifest's ``model.companions``: {directory: {file: {bytes, checksum}}} (the ``files`` table
    lists only the snapshot's own top-level files)."""
    return {d: {n: {"bytes": b, checksum.DEFAULT: h} for n, (b, h) in sorted(fs.items())}
            for d, fs in sorted(companions.items())}


class Committer:
    """The coordinator's side of a snapshot: what lands in ``output_dir`` and under which run."""

    def __init__(self, config: FullParamConfig, ctx, output_dir: Path, pattern):
        self.config, self.ctx, self.output_dir, self.pattern = config, ctx, output_dir, pattern
        self.run_id, self.seq = new_run_id(), 1  # settled when the session starts
        self.lock = None  # the coordinator's lock of output_dir (commit.lock), set when the session starts
        # the evaluation hook (trainer/evaluation.py): told of each commit; its snapshots in line or being
        # evaluated are kept by retention
        self.on_commit: Optional[Callable[[ExportJob], None]] = None
        self.busy: Callable[[], Iterable[str]] = lambda: ()
        self._after_lock = threading.Lock()  # after_commit: a background commit's and the training thread's

    def _diagnose(self, job: ExportJob) -> Optional[str]:
        """After a failed export (every rank calls it): what the coordinator's lock says happened to
        output_dir meanwhile (removed, replaced: the usual cause of a staging file that vanished)."""
        found = None
        if self.ctx.is_coordinator and self.lock is not None and job.pointers:
            if self.lock.verify("after the export failed"):
                found = "; ".join(self.lock.take_events())
        return self.ctx.all_gather_object(found, what="diagnosis")[self.ctx.coordinator]

    def check_target(self, final: Path) -> None:
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

    def finish_global(self, job: ExportJob) -> SnapshotInfo:
        """Status exchange, then the coordinator commits and everyone learns the outcome."""
        ctx, name, step = self.ctx, job.name, job.step
        statuses = ctx.all_gather_object((job.error, {k: (v.bytes, v.digest) for k, v in job.files.items()},
                                          job.traffic), what="status exchange")
        errors = [(r, st[0]) for r, st in enumerate(statuses) if st[0]]
        if errors:
            if ctx.is_coordinator and job.staging is not None:
                shutil.rmtree(job.staging, ignore_errors=True)
            r, e = errors[0]
            where = f" (rank {r})" if ctx.world_size > 1 else ""
            cause = self._diagnose(job)
            raise ExportError(f"export of step {step} to {job.out_dir / name} failed{where}: {e}"
                              + (f". The cause: {cause}" if cause else ""))
        all_files = {k: v for st in statuses for k, v in st[1].items()}
        job.traffic_by_rank = {r: st[2] for r, st in enumerate(statuses) if st[2]}
        timings = {"plan_s": job.t_plan - job.t0, "assemble_write_s": job.t_stream - job.t_plan,
                   "flush_s": job.t_written - job.t_stream}
        if job.thread is not None:  # async_write: how long training waited (the rest ran in the background)
            timings["stall_s"] = job.stall_s
        if job.device is not None and job.device.stats.d2h_bytes:  # parameters on an accelerator
            timings["device_to_host_s"] = job.device.stats.d2h_s
        if not job.exporter.writes_files:
            total = time.perf_counter() - job.t0
            return SnapshotInfo(name, step, None, 0, 0, job.p.plan.num_tensors, total, timings, job.reason, stall_s=total)
        error, final = None, job.out_dir / name
        if ctx.is_coordinator:
            try:
                self.commit(job, all_files, timings)
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
            stalled = "" if job.reason == "convert" else f", training stalled {stall:.2f} s"  # no training to stall
            logger.info(
                "snapshot %s (step %d, %s): %d files, %.1f MB in %.2f s (%.2f GB/s)%s%s",
                name if job.pointers else f"{job.out_dir.name}/{name}", step, job.reason or "export", info.files,
                info.bytes / 1e6, total, info.bytes / 1e9 / max(total, 1e-9), stalled,
                traffic_line(job.traffic_by_rank, info.bytes),
            )
        return info

    def commit(self, job: ExportJob, files, timings) -> None:
        staging, name, p, source = job.staging, job.name, job.p, job.source
        _faults.point("side_files")
        extra = self.write_side_files(staging, source, p.plan, p.fp8)
        topo = self.ctx.topology
        manifest = build_manifest(
            name=name, step=job.step, reason=job.reason, metrics=job.metrics, config=self.config, plan=p.plan,
            files={**files, **extra}, timings=timings, framework=source.framework,
            model={**source.notes, **({"padding_rows_zeroed": p.zero_rows} if p.zero_rows else {}),
                   **({"quantization": p.fp8.describe()} if p.fp8 is not None else {}),
                   **({"companions": _companion_table(job.companions)} if job.companions else {})},
            run={"id": self.run_id, "seq": self.seq},
            topology={
                "world_size": topo.world_size, "axes": [list(a) for a in topo.axes],
                "sharding_stage": topo.sharding_stage, "meshes": [[list(r) for r in m.rows] for m in topo.meshes],
                "writers": {str(r): fs for r, fs in sorted(p.writes.writers().items())},
                "assembler": self.config.assembler,
                "schedule": self.config.topology.schedule,
                "nodes": list(getattr(self.ctx, "nodes", ()) or ()),
                "writer_balance": round(p.balance, 4), **({"balance_note": p.balance_note} if p.balance_note else {}),
            },
            traffic=traffic_record(job.traffic_by_rank, self.config.topology.schedule),
        )
        _faults.point("manifest")
        commit.write_json_durable(staging / commit.MANIFEST, manifest)
        # latest's new content is written now: a full disk fails here, before the snapshot is visible
        latest = commit.prepare_pointer(self.output_dir, "latest", name) if job.pointers else None
        try:
            _faults.point("rename")
            commit.commit_staging(staging, job.out_dir, name)
        except BaseException:
            commit.discard_pointer(latest)
            raise
        self.seq += 1
        _faults.point("latest")
        if latest is not None:
            commit.install_pointer(self.output_dir, "latest", latest)
        if self.on_commit is not None:
            try:
                self.on_commit(job)
            except Exception as e:  # the snapshot is committed: an evaluation that cannot be queued is no failure of it
                logger.warning("snapshot %s is committed, but its evaluation could not be queued: %s", name, e)
        if latest is not None:
            self.after_commit(name)

    def after_commit(self, name: Optional[str]) -> None:
        """Point ``best`` at the best snapshot by the tracked metric, then apply retention.

        ``name`` is committed and ``latest`` names it already: a failure here (a full disk while
        ``best`` is written) is logged, not raised, and both are tried again after the next commit.
        ``None``: a refresh after new evaluation scores. Snapshots the evaluation hook holds are kept."""
        ret = self.config.retention
        try:
            with self._after_lock:
                _faults.point("best")
                update_best(self.output_dir, self.pattern, ret.metric, ret.mode, self.run_id, ret.other_runs)
                _faults.point("retention")
                removed = apply_retention(self.output_dir, self.pattern, ret.keep_last,
                                          protect=[*([name] if name else []), *self.busy()], keep_best=ret.keep_best,
                                          metric=ret.metric, mode=ret.mode, run_id=self.run_id,
                                          other_runs=ret.other_runs)
        except OSError as e:
            logger.warning("snapshot %s is committed, but updating 'best' / retention in %s failed (%s: %s); both "
                           "are tried again after the next commit", name, self.output_dir, type(e).__name__, e)
            return
        if removed:
            logger.info("retention (keep_last=%d, keep_best=%d) removed %s", ret.keep_last, ret.keep_best, removed)

    def write_side_files(self, staging: Path, source: ModelSource, plan: ExportPlan, fp8=None) -> Dict[str, tuple]:
        """Index, config.json (with ``fp8``'s quantization_config), generation_config.json, tokenizer files ->
        {file: (bytes, digest)}."""
        written = []
        if plan.needs_index:
            commit.write_json_durable(staging / commit.INDEX, plan.index())
            written.append(commit.INDEX)
        if self.config.export.format == "hf_safetensors":
            _faults.point("config")
            if source.hf_config is not None:
                cfg = dict(source.hf_config)
                dtype = dominant_float_dtype(plan)
                if dtype:
                    cfg["dtype"] = dtype  # transformers >= 4.56 writes and reads this key (torch_dtype before)
                if fp8 is not None:
                    cfg["quantization_config"] = fp8.config()
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
