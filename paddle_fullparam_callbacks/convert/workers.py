"""``convert --workers N``: N processes write one snapshot, each its share of the files.

The callback's replica split without a training job: the workers form a world of N data-parallel
ranks, each a mesh of one (``plan_topology([("data", N)])``), so the export plan gives each its
files, worker 0 (the coordinator) makes the staging directory and commits, and the others write
their files at the same time. The few object exchanges an export needs go through pipes to
worker 0 (``PipeContext``); a worker that dies closes its pipe, which ends the others' waits
with an error instead of a hang.

Each worker indexes the checkpoint and builds the lazy model itself (nothing is pickled across
but paths and the config) and reads only the tensors of its files. With ``export.threads: auto`` the
workers share this process's cores: each gets its affinity divided by the number of workers.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from ..config.recipes import load_config
from ..export.session.distributed import LocalContext
from ..export.source import ExportError, SnapshotInfo
from ..host.pool import usable_cores
from ..plan.topology import plan_topology
from .checkpoints import CheckpointError
from .prepare import export_conversion, prepare

logger = logging.getLogger("paddle_fullparam_callbacks")


@dataclass
class PipeContext(LocalContext):
    """A worker of ``convert --workers``: exchanges go through worker 0 over pipes."""

    conns: Optional[List[Any]] = None  # worker 0: a pipe to each other worker (index r-1); others: [to worker 0]

    def all_gather_object(self, obj, group=None, what: str = "exchange") -> List[Any]:
        try:
            if self.rank == 0:
                gathered = [obj] + [c.recv() for c in self.conns]
                for c in self.conns:
                    c.send(gathered)
                return gathered
            self.conns[0].send(obj)
            return self.conns[0].recv()
        except (EOFError, OSError) as e:
            raise ExportError(f"convert worker {self.rank}: another worker stopped during {what} ({type(e).__name__})") from e

    def mesh_gather_object(self, obj, what: str = "mesh exchange") -> List[Any]:
        return [obj]  # every worker is a mesh of one

    def barrier(self) -> None:
        self.all_gather_object(None, what="barrier")


def _worker(rank: int, world: int, conns, checkpoint_dir: str, output_dir: str, config, model_config,
            step, results, lora=None) -> None:
    ctx = PipeContext(rank=rank, world_size=world, topology=plan_topology([("data", world)]), conns=conns)
    try:
        conv = prepare(checkpoint_dir, config, model_config, step, **(lora or {}))
        info = export_conversion(conv, Path(output_dir), config, ctx=ctx)
        results.put((rank, "ok", info))
    except BaseException as e:  # reported to the parent, which raises it
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))


def convert_in_workers(checkpoint_dir, output_dir: Path, config, model_config, step, workers: int,
                       lora=None, default_step=None) -> SnapshotInfo:
    """Run the conversion in ``workers`` processes; returns worker 0's SnapshotInfo, or raises the first error.

    Everything that can be checked without the output directory is checked here first, in this
    process (a bad checkpoint fails once, not N times); the step it finds is the workers'."""
    step = prepare(checkpoint_dir, config, model_config, step, **(lora or {}), default_step=default_step).step
    if config.export.threads == "auto":  # the workers divide the cores between them, as a node's ranks do
        config = load_config(None, [f"export.threads={max(1, usable_cores() // workers)}"], base=config)
    spawn = mp.get_context("spawn")  # Paddle is not fork-safe once initialised
    pipes = [spawn.Pipe() for _ in range(workers - 1)]
    results = spawn.Queue()
    procs = []
    for rank in range(workers):
        conns = [a for a, _ in pipes] if rank == 0 else [pipes[rank - 1][1]]
        p = spawn.Process(target=_worker, name=f"pfc-convert-{rank}", daemon=True,
                          args=(rank, workers, conns, str(checkpoint_dir), str(output_dir), config, model_config, step, results,
                                lora))
        p.start()
        procs.append(p)
    for a, b in pipes:  # only the workers hold the pipes now: a dead worker's end closes
        a.close()
        b.close()
    outcomes = {}
    while len(outcomes) < workers:
        try:
            rank, kind, value = results.get(timeout=5)
            outcomes[rank] = (kind, value)
        except Exception:  # queue.Empty: a worker that died without a word
            for rank, p in enumerate(procs):
                if rank not in outcomes and not p.is_alive() and p.exitcode not in (0, None):
                    outcomes[rank] = ("error", ("WorkerDied", f"worker {rank} exited with code {p.exitcode}", ""))
    for p in procs:
        p.join()
    errors = sorted((r, v) for r, (k, v) in outcomes.items() if k == "error")
    if errors:
        rank, (kind, message, tb) = errors[0]
        logger.debug("convert worker %d failed:\n%s", rank, tb)
        if kind in ("CheckpointError", "ConvertError"):  # a file that changed after it was indexed, in a worker
            raise CheckpointError(f"convert worker {rank}: {message}")
        raise ExportError(f"convert worker {rank} failed: {kind}: {message}")
    return outcomes[0][1]
