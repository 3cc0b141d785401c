"""``paddle-fullparam serve SNAPSHOT|OUTPUT_DIR [--to URL ...]``: a snapshot already on disk offered to the
engines of a recipe, with the same proof, swap, records and logs as during training.

The path is a snapshot (it holds the package's manifest) or an output directory, whose ``latest`` (else its
newest snapshot) is offered. The snapshot's own files say what an engine's model must be. The output
directory's lock is taken for the record's sake (a live job that holds it serves its own snapshots, so this
command then stops and says so); what earlier jobs' swaps left is settled first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...config.schema import ConfigError, FullParamConfig
from ...export.commit.lock import OutputDirLocked, acquire_lock
from ...export.commit.ownership import read_manifest
from ...export.commit.pointers import read_pointer
from ...export.commit.retention import list_snapshots, newest_run
from ...plan.naming import snapshot_step_pattern
from .fit import read_model_dir
from .hook import ServeHook, Serving
from .probe import initial_states, prove_engines
from .recovery import recover

WAIT_FOREVER_S = 10 ** 9  # each swap is bounded by the timeouts of its calls anyway


def find_snapshot(path: "str | Path", config: FullParamConfig) -> Path:
    """The snapshot ``path`` names: itself, or an output directory's ``latest`` (else its newest snapshot)."""
    path = Path(path)
    if read_manifest(path) is not None:
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such snapshot or output directory")
    pattern = snapshot_step_pattern(config.export.name_template)
    latest = read_pointer(path, "latest")
    if latest and read_manifest(path / latest) is not None:
        return path / latest
    found = list_snapshots(path, pattern)
    if not found:
        raise FileNotFoundError(f"{path}: neither a snapshot (no fullparam_manifest.json) nor an output directory "
                                f"holding one named like export.name_template ({config.export.name_template!r})")
    return max(found, key=lambda e: e.step).path


def serve_path(path: "str | Path", config: FullParamConfig, say: Callable[[str], None] = print) -> Serving:
    """Offer one snapshot to every engine of ``config.serve``; returns its swap, recorded beside it. Raises
    ConfigError without an engine, FileNotFoundError without a snapshot, OutputDirLocked when a live job holds
    the directory, and the probe's ServeStartFailed."""
    cfg = config.serve
    if not cfg.enabled:
        raise ConfigError("serve.url", "is not set: give --to http://host:port (each engine) or a recipe with a serve "
                                       "section")
    snapshot = find_snapshot(path, config).resolve()
    output_dir = snapshot.parent
    step = read_manifest(snapshot).get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else 0
    lock = acquire_lock(output_dir, owner="paddle-fullparam serve")
    try:
        probes = prove_engines(cfg, read_model_dir(snapshot) if cfg.check_model else None, say=say)
        pattern = snapshot_step_pattern(config.export.name_template)
        run = newest_run(output_dir, pattern) or "paddle-fullparam-serve"
        hook = ServeHook(cfg, initial_states(cfg, probes, output_dir), run, skip_behind=False)
        left = recover(hook, [(snapshot.name, step, snapshot)], cfg.urls)
        for job in left["settled"]:
            say(f"{job.name}: a swap an earlier job left, recorded now")
        say(f"serving {snapshot.name} (step {step}) on {', '.join(cfg.urls)}")
        hook.committed(snapshot.name, snapshot, step)
        hook.close(WAIT_FOREVER_S)
        done = [j for j in hook.drain() if j.name == snapshot.name and not j.recovered]
    finally:
        lock.release()
    return done[-1]


__all__ = ["OutputDirLocked", "find_snapshot", "serve_path"]
