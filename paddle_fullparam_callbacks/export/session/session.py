"""One export, end to end: plan (cached), assemble, write, commit, point ``latest``, retain.

The same flow serves one process and many ranks (``ctx``: see ``distributed.py``):

1. metadata: the mesh's shard records (one exchange, the first time), checked for consistency;
2. mapping and plans: destination tensors, shard files, the split of files across meshes and
   writers; every rank must compute the same export plan (``planning.py``);
3. the coordinator creates the staging directory and tells everyone its name;
4. each mesh assembles its split (``streaming.py``); each rank writes only its own files, all at
   the same time;
5. status exchange: every rank learns whether every rank succeeded, and the per-file sizes and
   checksum; on any failure everyone raises the same error and the coordinator removes staging;
6. the coordinator writes index, config, tokenizer, manifest (last), renames, updates
   ``latest`` and retention; a last exchange tells everyone the outcome (``finishing.py``).

Everything that can be checked is checked before the first byte. A failure after that removes
the staging directory: nothing half-written stays visible. With ``export.async_write`` steps 5-6
run after training resumed (in the background with one rank; at the next export with several).
"""
from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from ... import _faults
from ...assemble.device import DeviceBoundary
from ...config.schema import ConfigError, FullParamConfig
from ...host import pool as workers
from ...plan.naming import format_snapshot_name, snapshot_step_pattern
from .. import commit
from ..commit.manifest import clean_metrics
from ..source import ExportError, ModelSource, SnapshotInfo
from . import preflight, startup
from .companions import write_companions
from .distributed import LocalContext
from .exporters import Exporter, load_callable, make_exporter
from .finishing import Committer, ExportJob, finish_local
from .planning import PreparedExport, plan_export
from .streaming import progress_bar, stream_tensors

logger = logging.getLogger("paddle_fullparam_callbacks")


class ExportSession:
    """Holds what stays the same across a job's exports (the mapping and the plans)."""

    def __init__(self, config: FullParamConfig, output_dir: "str | Path", fn: Optional[Callable] = None, ctx=None):
        self.config = config
        self.output_dir = Path(output_dir)
        self.fn = fn
        self.ctx = ctx or LocalContext()
        self._prepared: Optional[PreparedExport] = None
        self._pending: Optional[ExportJob] = None
        self._atexit_registered = False
        self._ring = None
        self._shrink_said = False
        self._lock = None
        self._created_dir = False
        self.is_open = False  # between start() and close()
        self.start_timings: dict = {}  # seconds of start()'s parts (the visibility proof's, with several ranks)
        self.pattern = snapshot_step_pattern(config.export.name_template)
        self.committer = Committer(config, self.ctx, self.output_dir, self.pattern)

    @property
    def run_id(self) -> str:
        return self.committer.run_id

    def start(self, resume: bool = False, shared: Sequence[Tuple[str, Path]] = ()) -> List[str]:
        """Check output_dir, take its lock, remove leftovers of interrupted exports that are provably
        this package's, and settle this job's run (coordinator); all ranks call it.

        ``resume``: the trainer resumed from a checkpoint; the job continues the run of the newest
        snapshot here (re-exporting its steps replaces them). Otherwise it is a new run, which never
        replaces or deletes another run's snapshots (unless ``retention.other_runs: delete``).

        With several ranks, every rank then proves it sees the same output_dir (and each directory of
        ``shared``: (recipe key, path) pairs, e.g. the trainer's checkpoints for the checkpoint hook)
        as the coordinator: a ConfigError on every rank otherwise (see ``commit.visibility``).

        The claim, the proof and the watchdog are ``startup.py``'s; here, their order and what follows.
        """
        writes = self.config.export.format != "callable"
        if not writes and self.fn is None:
            self.fn = load_callable(self.config.export.callable)  # every rank: a ConfigError now, not at the first export
        targets = [("output_dir", self.output_dir), *shared] if writes and self.ctx.world_size > 1 else []
        claim = startup.Claim()
        if self.ctx.is_coordinator and writes:
            try:
                claim.take(self.output_dir, self.pattern, resume, targets, holder=self)
            finally:  # the lock is this session's from the moment it is taken
                self._created_dir = claim.created
                if claim.lock is not None:
                    self._lock = self.committer.lock = claim.lock
        gathered = self.ctx.all_gather_object(claim.shared)
        errors = [e for e, _, _ in gathered if e]
        if errors:
            kind, message = errors[0]
            startup.remove_tokens(self.ctx, targets, claim.tokens)
            raise startup.claim_error(kind, message)
        self.committer.run_id, self.committer.seq = gathered[self.ctx.coordinator][1]
        unshared = startup.prove_shared(self.ctx, targets, gathered[self.ctx.coordinator][2], self.start_timings)
        if unshared:
            if self._lock is not None:
                self.close()
            raise ConfigError(*unshared)
        if self.ctx.watchdog is None:
            self.ctx.watchdog = startup.watchdog(self.config.export.timeout_s, self.ctx, self.output_dir, self._lock)
        self.is_open = True
        if self.ctx.is_coordinator and self.config.export.format != "callable":
            logger.info("full-parameter snapshots go to %s (run %s)", self.output_dir, self.run_id)
        if claim.removed:
            logger.info("removed %d leftover(s) of interrupted exports in %s: %s", len(claim.removed), self.output_dir,
                        claim.removed)
        return claim.removed

    def close(self) -> None:
        """Finish a pending background export and release the output directory (also done at exit)."""
        self.wait_pending()
        self.is_open = False
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.close()
            self.ctx.watchdog = None
        if self._lock is not None:
            self._lock.release()
            self._lock = self.committer.lock = None
            if self._created_dir:
                startup.remove_unused(self.output_dir)

    def prepare(self, source: ModelSource, sharded_state_dict: Optional[dict] = None, ring: bool = True) -> PreparedExport:
        """Mapping and plans; recomputed only when some rank's parameter names, shapes or dtypes change.

        A collective on every rank (cheap when nothing changed: one digest exchange). ``ring``: also build the
        async staging ring (:meth:`stage_ring`); the callback builds it after the first training step instead.
        """
        sd = sharded_state_dict
        if sd is None and source.tensors is None:
            sd = source.sharded_state_dict()
        self._prepared = plan_export(self.ctx, self.config, source, sd, self._prepared)
        if ring:
            self.stage_ring()
        return self._prepared

    def stage_ring(self) -> None:
        """Allocate and touch the async staging ring now (no collective), not during the first export; nothing
        if there is one, no plan yet, or a background export is pending. The callback calls it at the end of
        the first training step: the optimizer's states exist by then, and the ring is sized from what the
        training leaves (``ring_size.py``)."""
        if self.config.export.async_write and self._ring is None and self._pending is None and self._prepared is not None:
            self._host_ring()

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
        workers.shared(cfg.export.threads)  # the byte work of this export (copies, casts, merges, hashes)
        try:
            exporter: Exporter = make_exporter(cfg.export, self.fn, self._host_ring())
            sd = source.sharded_state_dict() if source.tensors is None else None
        except Exception as e:  # the same on every rank, before any collective: through on_error
            raise ExportError(f"export of step {step} failed before it started: {type(e).__name__}: {e}") from e
        p = self.prepare(source, sd)
        mesh_files = p.writes.files_of_mesh(ctx.mesh.index)
        my_files = p.writes.files_of_rank(ctx.rank)
        if not exporter.writes_files:  # callable: the mesh's tensors go to fn on each rank of the mesh
            my_files = mesh_files
        targets = [n for n in p.order if p.plan.slots[n].file_index in set(mesh_files)]
        keep = {n for n in targets if p.plan.slots[n].file_index in set(my_files)}

        if exporter.writes_files:  # room on every rank, the directory still this job's: or nothing is written
            preflight.check(ctx, self._lock if into is None else None, out_dir, p.plan, my_files, step,
                            str(out_dir / name))

        # the coordinator makes the staging directory and tells everyone its name
        staging, error = None, None
        if exporter.writes_files and ctx.is_coordinator:
            try:
                commit.check_output_dir(out_dir)
                self.committer.check_target(out_dir / name)
                staging = commit.new_staging_dir(out_dir, name, self.run_id)
            except OSError as e:
                error = f"{type(e).__name__}: {e}"
        first = ctx.all_gather_object((str(staging) if staging else None, error), what="staging")[ctx.coordinator]
        if first[1]:
            raise ExportError(f"export of step {step} to {out_dir / name} failed: {first[1]}")
        _faults.point("staging")
        job = ExportJob(name, step, reason, metrics, p, Path(first[0]) if first[0] else None, exporter, source,
                        len(keep), t0, time.perf_counter(), out_dir=out_dir, pointers=into is None)
        self._assemble_and_write(job, sd, targets, keep, my_files)
        if cfg.export.async_write and exporter.writes_files and job.error is None:
            # training resumes now; the writer drains in the background (and, single-process,
            # commits there too; with several ranks the commit needs collectives, so the next
            # export / wait_pending() does it on the training thread)
            job.thread = threading.Thread(target=self._background, args=(job,), name="pfc-commit", daemon=True)
            # the stall ends here, and is set before the background thread (which records it) can run
            stall = job.stall_s = time.perf_counter() - t0
            job.thread.start()
            self._pending = job
            if not self._atexit_registered:
                atexit.register(self._wait_at_exit)
                self._atexit_registered = True
            return SnapshotInfo(name, step, out_dir / name, 0, 0, p.plan.num_tensors, stall,
                                {"stall_s": stall}, reason, pending=True, stall_s=stall)
        finish_local(job, ctx.rank)
        return self.committer.finish_global(job)

    def _assemble_and_write(self, job: ExportJob, sd, targets: List[str], keep: set, my_files) -> None:
        """Assemble and write; an error stops this rank's writing, never its part in the collectives."""
        ctx, p = self.ctx, job.p
        progress = progress_bar(ctx.is_coordinator, sum(p.plan.slots[n].nbytes for n in keep), job.name)
        beat = ctx.watchdog.beat if ctx.watchdog is not None else (lambda: None)
        # a mesh of one hands its slices to the writer as they are: a background export's slices then leave the
        # device straight into the staging ring (elsewhere they are assembled into new arrays first, and a LoRA
        # merge's source would hold ring room while its result waits for some; a weight to quantize to FP8 is
        # several times the bytes the ring is sized for: its e4m3 bytes go into the ring, not the weight)
        direct = ctx.mesh.size == 1 and not job.source.local_transforms and p.fp8 is None
        boundary = job.device = DeviceBoundary(self.config.export.device_budget,
                                               host_alloc=job.exporter.host_alloc() if direct else None,
                                               background=self.config.export.async_write and job.exporter.writes_files)
        try:
            job.exporter.begin(p.plan, job.staging, job.step, my_files, fp8=p.fp8)
            with ctx.waiting("assembly", ctx.mesh_ranks):  # export.timeout_s: no tensor for that long ends the job
                for tname, tensor in stream_tensors(ctx, self.config, sd, p, job.source, targets, keep,
                                                    job.exporter.wait_for_room, boundary, job.traffic, beat):
                    beat()
                    if job.error is None:
                        try:
                            # an embedding's padding row goes out as zeros
                            job.exporter.write(tname, tensor, zero_row=p.zero_rows.get(tname))
                            job.seen += 1
                            _faults.point("tensor")
                            progress.update(p.plan.slots[tname].nbytes)
                        except Exception as e:
                            job.error = f"{type(e).__name__}: {e}"
                    tensor = None  # not held while the next one is read (the writer keeps what it still needs)
        except Exception as e:
            logger.debug("rank %d: assembly failed", self.ctx.rank, exc_info=True)  # where, for a developer
            job.error = job.error or f"{type(e).__name__}: {e}"
        finally:
            progress.close()
        if job.source.companions and job.exporter.writes_files:  # e.g. a PEFT adapter, in its own subdirectory
            try:
                job.companions = write_companions(ctx, self.config, p, job.source, job.staging, boundary)
            except Exception as e:
                job.error = job.error or f"{type(e).__name__}: {e}"
        job.t_stream = time.perf_counter()

    def _host_ring(self):
        """Host memory reused by every background export (pre-faulted once): see HostRing.

        Sized by ring_size: with ``export.max_pending_bytes: auto`` this rank's file bytes within its
        share of the node's available memory (said once when that share limits it), and made again,
        smaller, at an export that finds the node short of memory beside it (said once); otherwise the
        explicit size, or less when this rank's files are smaller. auto before the first plan (an export
        without ``prepare``): None, this export copies into fresh memory and its ``prepare`` builds the ring
        for the next ones."""
        export = self.config.export
        if not export.async_write or export.format == "callable":
            return None
        from .ring_size import capped_message, read_meminfo, ring_size, short_of_memory, shrunk_message

        shrunk_from = None
        if self._ring is not None and export.max_pending_auto:
            meminfo = read_meminfo()
            if short_of_memory(self._ring.size, meminfo, os.environ):
                shrunk_from, self._ring = self._ring.size, None
                gc.collect()  # its memory goes back before the new one is sized
        if self._ring is None:
            from .host import HostRing

            if self._prepared is None:
                if export.max_pending_auto:
                    return None
                size = export.max_pending
            else:
                p = self._prepared
                mine = sum(p.plan.files[i].data_bytes for i in p.writes.files_of_rank(self.ctx.rank))
                setting = None if export.max_pending_auto else export.max_pending
                sized = ring_size(mine, setting, read_meminfo() if setting is None else None, os.environ)
                if shrunk_from is not None:
                    if not self._shrink_said:
                        self._shrink_said = True
                        logger.warning("%s", shrunk_message(shrunk_from, sized.bytes, sized.available, self.ctx.rank))
                elif sized.capped:
                    logger.warning("%s", capped_message(sized, self.ctx.rank))
                size = sized.bytes
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
            return self.committer.finish_global(job)
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
        self.committer.after_commit(name)

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

    def _background(self, job: ExportJob) -> None:
        finish_local(job, self.ctx.rank)
        if self.ctx.world_size == 1:
            try:
                job.info = self.committer.finish_global(job)
            except BaseException as e:  # handed to wait_pending
                job.exception = e
