"""``paddle-fullparam publish OUTPUT_DIR [--to s3://bucket/prefix]``: the publisher, after the fact.

It takes the output directory's lock (one writer at a time: a live job that holds it publishes its own
snapshots, so this command then stops and says so), proves the store usable (the probe), settles what
earlier jobs left (``recovery.py``: a publication still running is waited for, an unfinished one resumed
from its journal), and publishes every snapshot whose record for this destination is not ``ok``
(``--all``: every snapshot), oldest first, one at a time, with the same engine, records and pointers as
during training; remote retention applies. It never removes anything local.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List

from ...config.schema import ConfigError, FullParamConfig
from ...plan.naming import snapshot_step_pattern
from ...export.commit.lock import OutputDirLocked, acquire_lock
from ...export.commit.retention import list_snapshots, newest_run
from . import records
from .hook import Publication, PublishHook
from .recovery import recover

WAIT_FOREVER_S = 10 ** 9  # each publication is bounded by publish.timeout_s anyway


def publish_path(output_dir: "str | Path", config: FullParamConfig, redo_all: bool = False,
                 say: Callable[[str], None] = print) -> List[Publication]:
    """Publish the snapshots of ``output_dir`` that need it; returns every publication settled or run now.
    Raises ConfigError without a destination, FileNotFoundError without snapshots, OutputDirLocked when a
    live job holds the directory, and the probe's ProbeFailed."""
    if not config.publish.enabled:
        raise ConfigError("publish.url", "is not set (nor publish.command): give --to s3://bucket/prefix or a recipe "
                                         "with a publish section")
    output_dir = Path(output_dir)
    pattern = snapshot_step_pattern(config.export.name_template)
    found = list_snapshots(output_dir, pattern) if output_dir.is_dir() else []
    if not found:
        raise FileNotFoundError(f"{output_dir}: holds no snapshot named like export.name_template "
                                f"({config.export.name_template!r})")
    lock = acquire_lock(output_dir, owner="paddle-fullparam publish")
    try:
        if config.publish.url:
            from .probe import probe
            from .store import Store

            for warning in probe(Store(config.publish, retries=min(config.publish.retries, 2)),
                                 config.publish.require_conditional_writes):
                say(f"warning: {warning}")
        hook = PublishHook(config, output_dir, newest_run(output_dir, pattern) or "paddle-fullparam-publish",
                           skip_behind=False)
        left = recover(hook, [(e.name, e.step, e.path, None) for e in found], hook.destination)
        for pub in left["settled"]:
            say(f"{pub.name}: left by an earlier job, recorded now: {pub.status}")
        queued = {p.name for p in left["adopted"] + left["todo"]}
        todo = 0
        for e in found:
            entry = records.read(e.path, hook.destination)
            if e.name in queued or (entry is not None and entry.get("status") == records.OK and not redo_all):
                continue
            hook.submit(Publication(e.name, e.path.resolve(), e.step))
            todo += 1
        say(f"publishing {todo + len(queued)} of {len(found)} snapshot(s) to {config.publish.url or config.publish.command}")
        hook.close(WAIT_FOREVER_S)
        done = [p for p in hook.drain() if p.kind == "snapshot"]
    finally:
        lock.release()
    return left["settled"] + sorted(done, key=lambda p: p.step)


__all__ = ["OutputDirLocked", "publish_path"]
