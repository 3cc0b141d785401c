"""One publication, end to end: the snapshot's files and manifest (``remote.publish_snapshot``), then the
store's ``latest`` (never to an older step) and ``best`` (the output directory's ``best``, once the store
holds it), then remote retention. The same code runs in the publishing process during training
(``worker.py``) and in ``paddle-fullparam publish``; :func:`sync_pointers` alone also runs in the job
when ``best`` moves to a snapshot already published.

A *spec* is a plain dict (it crosses a process boundary as JSON): ``snapshot``, ``name``, ``step``,
``output_dir``, ``work`` (the journal's folder), ``publish`` (the PublishConfig's fields),
``name_template``, ``run_id``, ``other_runs``, ``metric``, ``mode``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from ...config.schema import PublishConfig
from ...plan.naming import snapshot_step_pattern
from ...export.commit.pointers import read_pointer as read_local_pointer
from ...export.commit.retention import list_snapshots
from .journal import Journal
from .remote import apply_remote_retention, list_remote, publish_snapshot, read_pointer, remove_snapshot, swap_pointer
from .store import Store
from .upload import Uploader

JOURNAL = "journal.jsonl"


def config_of(spec: dict) -> PublishConfig:
    return PublishConfig(**spec["publish"])


def publish_one(spec: dict, store: Optional[Store] = None) -> dict:
    """Publish the spec's snapshot, then the pointers and retention; returns what was done (JSON-able)."""
    t0 = time.perf_counter()
    cfg = config_of(spec)
    store = store or Store(cfg)
    journal = Journal(Path(spec["work"]) / JOURNAL)
    uploader = Uploader(store, cfg, journal)

    def may_replace(remote: dict) -> bool:
        run = remote.get("run") if isinstance(remote.get("run"), dict) else {}
        return run.get("id") == spec.get("run_id") or spec.get("other_runs") == "delete"

    done = publish_snapshot(store, uploader, journal, Path(spec["snapshot"]), spec["name"], may_replace)
    seconds = time.perf_counter() - t0
    out = {"url": store.where(store.key(spec["name"])) + "/", "files": len(done.files) if not done.already else None,
           "bytes": sum(f.bytes for f in done.files), "sent_bytes": sum(f.sent_bytes for f in done.files),
           "parts": sum(f.parts for f in done.files), "reused_parts": sum(f.reused_parts for f in done.files),
           "already_published": done.already, "replaced": done.replaced, "aborted_uploads": done.aborted,
           "upload_s": round(seconds, 3)}
    out.update(sync_pointers(store, spec, published=spec["name"]))
    out["retried_requests"] = store.retried
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def sync_pointers(store: Store, spec: dict, published: Optional[str] = None) -> dict:
    """latest (forward only), best (the local one, if published), then retention; returns what they name."""
    cfg = config_of(spec)
    pattern = snapshot_step_pattern(spec["name_template"])

    def step_of(name: Optional[str]) -> Optional[int]:
        m = pattern.match(name or "")
        return int(m.group(1)) if m else None

    out = {}
    if published is not None:
        step = int(spec["step"])
        out["latest"] = swap_pointer(store, "latest", published,
                                     lambda cur: step_of(cur) is None or step_of(cur) < step)
    local_best = read_local_pointer(Path(spec["output_dir"]), "best") if spec.get("output_dir") else None
    if local_best and store.head(store.key(local_best, "fullparam_manifest.json")) is not None:
        out["best"] = swap_pointer(store, "best", local_best, lambda cur: True)
    if cfg.keep_last or cfg.keep_best:
        out["removed"] = _retention(store, spec, cfg, pattern, published)
    return out


def _retention(store: Store, spec: dict, cfg: PublishConfig, pattern, published: Optional[str]) -> list:
    snapshots, deleting = list_remote(store, pattern)
    for name in deleting:  # removals a crash interrupted
        remove_snapshot(store, name, None)
    if spec.get("other_runs") != "delete":
        snapshots = [s for s in snapshots if s.run == spec.get("run_id")]
    local = {}
    if spec.get("output_dir") and Path(spec["output_dir"]).is_dir():
        local = {e.name: e.metrics for e in list_snapshots(Path(spec["output_dir"]), pattern)}
    metric = spec.get("metric")

    def metric_of(s) -> Optional[float]:
        if not metric:
            return None
        metrics = {**s.metrics, **local.get(s.name, {})}  # the evaluation hook's scores live beside the local copy
        for key in (metric, f"eval_{metric}"):
            v = metrics.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
        return None

    protect = [n for n in (read_pointer(store, p)[0] for p in ("latest", "best")) if n]
    protect += [published] if published else []
    return apply_remote_retention(store, snapshots, cfg.keep_last, cfg.keep_best, metric_of,
                                  spec.get("mode") or "min", protect)
