"""A snapshot on the store, and the store's ``latest``, ``best`` and retention.

Object stores have no rename, so the commit protocol becomes an order of requests::

    <prefix>/<name>/<every file of the manifest>      final keys, each checked after upload
    <prefix>/<name>/fullparam_manifest.json           last, with If-None-Match: *  (the commit)
    <prefix>/latest, <prefix>/best                    compare-and-swap (If-Match / If-None-Match)

A prefix without a manifest is not a snapshot. Removing one (retention, or replacing a snapshot of the
same name) writes ``<prefix>/<name>/.fullparam-deleting`` first, then deletes the manifest (the
snapshot is gone for readers from that request on), then the files, then the marker: a crash in between
leaves a prefix that carries the package's marker, which the next publication or retention finishes
removing. Nothing under the prefix is removed without that proof.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ... import _faults
from ...export.commit import MANIFEST
from ...export.write import checksum
from .journal import Journal
from .store import Store, StoreError, md5_b64
from .upload import FileResult, Uploader

DELETING = ".fullparam-deleting"
POINTERS = ("latest", "best")
CAS_TRIES = 10


class RemoteConflict(StoreError):
    """The store holds something this publication must not replace (another run's snapshot, another writer's manifest)."""


def snapshot_files(snapshot: Path, manifest: dict) -> List[Tuple[str, int, Optional[Tuple[str, str]]]]:
    """(relative path, bytes, (algorithm, digest)) of every file the manifest lists, its companions'
    (``model.companions``: e.g. ``adapter/``) included; the manifest itself is not among them."""
    out = []
    algorithm = manifest.get("checksum") if manifest.get("checksum") in checksum.ALGORITHMS else None

    def add(rel: str, meta) -> None:
        if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int):
            raise ValueError(f"{snapshot / MANIFEST}: files[{rel!r}] has no byte count")
        algo = next((a for a in checksum.ALGORITHMS if isinstance(meta.get(a), str)), algorithm)
        out.append((rel, meta["bytes"], (algo, meta[algo]) if algo and isinstance(meta.get(algo), str) else None))

    for name, meta in sorted((manifest.get("files") or {}).items()):
        add(name, meta)
    companions = (manifest.get("model") or {}).get("companions") or {}
    for directory, files in sorted(companions.items()):
        for name, meta in sorted((files or {}).items()):
            add(f"{directory}/{name}", meta)
    for rel, _, _ in out:
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts) or "\\" in rel or rel == MANIFEST:
            raise ValueError(f"{snapshot / MANIFEST}: names the file {rel!r}, which is not a plain relative path")
    return out


@dataclass
class Published:
    name: str
    files: List[FileResult]
    already: bool = False  # the store held this very snapshot (same manifest bytes)
    replaced: bool = False  # the store held another snapshot of this name (this run's), removed first
    aborted: int = 0  # multipart uploads found open under the snapshot's prefix and aborted


def publish_snapshot(store: Store, uploader: Uploader, journal: Journal, snapshot: Path, name: str,
                     may_replace: Callable[[dict], bool]) -> Published:
    """Copy the committed snapshot ``snapshot`` to ``<prefix>/<name>/``, its manifest last and conditionally.

    ``may_replace(remote_manifest)`` says whether a different snapshot of the same name on the store may
    be replaced (this run's); otherwise :class:`RemoteConflict`."""
    manifest_bytes = (snapshot / MANIFEST).read_bytes()
    manifest = json.loads(manifest_bytes)
    files = snapshot_files(snapshot, manifest)
    base = store.key(name)
    mkey = f"{base}/{MANIFEST}"
    result = Published(name, [])
    current = store.get(mkey)
    if current is not None and current[0] == manifest_bytes:
        result.already = True
        _check_files(store, base, files)
        result.aborted = abort_strays(store, journal, base)
        return result
    if current is not None:
        try:
            remote = json.loads(current[0])
        except ValueError:
            remote = {}
        if not may_replace(remote if isinstance(remote, dict) else {}):
            run = (remote.get("run") or {}).get("id") if isinstance(remote, dict) else None
            raise RemoteConflict(f"{store.where(mkey)} is the manifest of another snapshot (run {run}, step "
                                 f"{remote.get('step') if isinstance(remote, dict) else '?'}); this run does not replace "
                                 "it. Publish to another prefix, or set retention.other_runs=delete")
        remove_snapshot(store, name, current[1])
        result.replaced = True
    elif store.head(f"{base}/{DELETING}") is not None:
        remove_snapshot(store, name, None)  # a removal a crash interrupted: finished first
    open_ids = {e["upload_id"] for e in journal.open_uploads(store.url).values()}
    result.aborted = abort_strays(store, journal, base, keep=open_ids)
    for rel, size, expected in files:
        result.files.append(uploader.upload(snapshot / rel, f"{base}/{rel}", size, expected))
        _faults.point("publish_file")
    _faults.point("publish_manifest")
    _, b64 = md5_b64(manifest_bytes)
    try:
        store.call("put_object", mkey, Body=manifest_bytes, ContentMD5=b64, IfNoneMatch="*")
    except StoreError as e:
        if e.status != 412 and e.code != "PreconditionFailed":
            raise
        again = store.get(mkey)  # a retried PUT whose first attempt went through, or another writer
        if again is None or again[0] != manifest_bytes:
            raise RemoteConflict(f"{store.where(mkey)} was written by another writer while this snapshot was "
                                 "published; this publication stops (its files stay, without a manifest of ours)",
                                 e.code, e.status) from e
    result.aborted += abort_strays(store, journal, base)
    journal.clear()
    return result


def _check_files(store: Store, base: str, files) -> None:
    for rel, size, _ in files:
        head = store.head(f"{base}/{rel}")
        if head is None or int(head.get("ContentLength", -1)) != size:
            raise StoreError(f"{store.where(f'{base}/{rel}')}: listed by the published manifest but "
                             f"{'missing' if head is None else 'of another size'} on the store")


def abort_strays(store: Store, journal: Journal, base: str, keep=()) -> int:
    """Abort every multipart upload open under ``<base>/`` except ``keep``; returns how many."""
    n = 0
    for key, upload_id in store.uploads(f"{base}/"):
        if upload_id in keep:
            continue
        store.abort(key, upload_id)
        journal.done(store.url, key, upload_id)
        n += 1
    return n


def remove_snapshot(store: Store, name: str, manifest_etag: Optional[str]) -> None:
    """Marker, manifest (If-Match its ETag when known), files, marker: see the module's docstring."""
    base = store.key(name)
    store.put(f"{base}/{DELETING}", b"removed by paddle_fullparam_callbacks\n")
    try:
        store.delete(f"{base}/{MANIFEST}", **({"IfMatch": f'"{manifest_etag}"'} if manifest_etag else {}))
    except StoreError as e:
        if e.status != 404:
            raise
    _faults.point("publish_remove")
    keys = [k for k, _, _ in store.list(f"{base}/")[0] if not k.endswith(f"/{DELETING}")]
    store.delete_many(keys)
    for key, upload_id in store.uploads(f"{base}/"):
        store.abort(key, upload_id)
    store.delete(f"{base}/{DELETING}")


# ---- what the store holds ------------------------------------------------------------------
@dataclass
class RemoteSnapshot:
    name: str
    step: int
    run: Optional[str]
    seq: int
    created: float
    metrics: dict
    etag: str


def list_remote(store: Store, pattern) -> Tuple[List[RemoteSnapshot], List[str]]:
    """The snapshots under the prefix (a name matching ``pattern`` with a manifest), oldest step first,
    and the names that carry the deletion marker (removals a crash interrupted)."""
    keys, dirs = store.list(store.key("") + "/" if store.prefix else "", delimiter="/")
    out, deleting = [], []
    for d in dirs:
        name = d.rstrip("/").rsplit("/", 1)[-1]
        m = pattern.match(name)
        if not m:
            continue
        got = store.get(f"{d}{MANIFEST}")
        if got is None:
            if store.head(f"{d}{DELETING}") is not None:
                deleting.append(name)
            continue
        try:
            manifest = json.loads(got[0])
        except ValueError:
            continue
        run = manifest.get("run") if isinstance(manifest.get("run"), dict) else {}
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        out.append(RemoteSnapshot(name, int(m.group(1)), run.get("id"), run.get("seq") if isinstance(run.get("seq"), int) else 0,
                                  float(manifest.get("created_unix") or 0), metrics, got[1]))
    out.sort(key=lambda s: (s.step, s.name))
    return out, deleting


def read_pointer(store: Store, pointer: str) -> Tuple[Optional[str], Optional[str]]:
    got = store.get(store.key(pointer))
    if got is None:
        return None, None
    return got[0].decode("utf-8", "replace").strip() or None, got[1]


def swap_pointer(store: Store, pointer: str, name: str, accept: Callable[[Optional[str]], bool]) -> Optional[str]:
    """Point ``pointer`` at ``name`` if ``accept(current name)``, by compare-and-swap: If-Match the ETag
    read (If-None-Match: * when there is none); a lost race reads again. Returns what it names after."""
    for _ in range(CAS_TRIES):
        current, etag = read_pointer(store, pointer)
        if current == name or not accept(current):
            return current
        condition = {"IfMatch": f'"{etag}"'} if etag else {"IfNoneMatch": "*"}
        try:
            store.put(store.key(pointer), (name + "\n").encode(), **condition)
            return name
        except StoreError as e:
            if e.status != 412 and e.code != "PreconditionFailed":
                raise
    raise StoreError(f"{store.where(store.key(pointer))}: {CAS_TRIES} compare-and-swap attempts lost to other writers")


def apply_remote_retention(store: Store, snapshots: List[RemoteSnapshot], keep_last: int, keep_best: int,
                           metric_of: Callable[[RemoteSnapshot], Optional[float]], mode: str,
                           protect: List[str]) -> List[str]:
    """Remove the snapshots outside the newest ``keep_last`` commits and the best ``keep_best``, never a
    protected one (latest, best, the one just published). Returns the names removed."""
    from ...plan.decisions import Candidate, to_remove

    order = sorted(snapshots, key=lambda s: (s.seq, s.created))
    doomed = to_remove([Candidate(s.name, s.step, metric_of(s), i) for i, s in enumerate(order)], keep_last,
                       keep_best, mode, protect)
    etags: Dict[str, str] = {s.name: s.etag for s in snapshots}
    for name in doomed:
        remove_snapshot(store, name, etags[name])
    return doomed
