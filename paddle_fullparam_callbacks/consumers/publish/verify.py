"""``paddle-fullparam verify s3://bucket/prefix``: published snapshots checked against their manifests.

The URL is a snapshot (it holds ``fullparam_manifest.json``) or a prefix of snapshots with ``latest`` and
``best``. For each snapshot: every file the manifest lists must be on the store with its size and its
checksum (BLAKE3, computed while the object is streamed, never held whole), and no ``.safetensors``
object may be there that the manifest does not list. A prefix without a manifest is not a snapshot: it is
listed as such (an upload in progress, or a removal a crash interrupted), not as damage. Each pointer
must name a snapshot under the prefix that verifies.
"""
from __future__ import annotations

import json

from pathlib import Path
from typing import Dict, List, Optional

from ...export.commit import MANIFEST
from ...export.write import checksum
from .remote import DELETING, POINTERS, read_pointer, snapshot_files
from .store import Store, StoreError

CHUNK = 8 * 2**20


def _report(path: str, kind: str = "snapshot") -> dict:
    return {"path": path, "kind": kind, "ok": True, "files": 0, "bytes": 0, "errors": [], "notes": []}


def _fail(report: dict, message: str) -> None:
    report["ok"] = False
    report["errors"].append(message)


def verify_snapshot(store: Store, base: str, check_hashes: bool = True) -> dict:
    """One snapshot at ``<base>/`` (a key prefix without the trailing slash)."""
    report = _report(store.where(base))
    got = store.get(f"{base}/{MANIFEST}")
    if got is None:
        _fail(report, f"{MANIFEST}: missing: not a snapshot")
        return report
    try:
        manifest = json.loads(got[0])
        files = snapshot_files(Path(base), manifest if isinstance(manifest, dict) else {})
    except ValueError as e:
        _fail(report, f"{MANIFEST}: {e}")
        return report
    listed = {rel for rel, _, _ in files}
    present = {k[len(base) + 1:]: size for k, size, _ in store.list(f"{base}/")[0]}
    for rel, size, expected in files:
        if rel not in present:
            _fail(report, f"{rel}: listed in the manifest but missing")
            continue
        report["files"] += 1
        report["bytes"] += present[rel]
        if present[rel] != size:
            _fail(report, f"{rel}: {present[rel]} bytes, the manifest says {size}")
        elif check_hashes and expected is not None:
            digest = _digest(store, f"{base}/{rel}", expected[0])
            if digest != expected[1]:
                _fail(report, f"{rel}: {expected[0]} differs from the manifest (the object was changed or damaged)")
    for rel in sorted(present):
        if rel.endswith(".safetensors") and rel not in listed:
            _fail(report, f"{rel}: on the store but not in the manifest")
    return report


def _digest(store: Store, key: str, algorithm: str) -> str:
    h = checksum.new(algorithm)
    body = store.call("get_object", key)["Body"]
    for chunk in iter(lambda: body.read(CHUNK), b""):
        h.update(chunk)
    return h.hexdigest()


def verify_url(store: Store, check_hashes: bool = True) -> List[dict]:
    """Reports for the store's URL: one snapshot, or every snapshot and pointer under the prefix."""
    base = store.prefix
    if base and store.head(f"{base}/{MANIFEST}") is not None:
        return [verify_snapshot(store, base, check_hashes)]
    keys, dirs = store.list(f"{base}/" if base else "", delimiter="/")
    reports: Dict[str, dict] = {}
    for d in dirs:
        name = d.rstrip("/").rsplit("/", 1)[-1]
        sub = d.rstrip("/")
        if store.head(f"{sub}/{MANIFEST}") is not None:
            reports[name] = verify_snapshot(store, sub, check_hashes)
        else:
            r = _report(store.where(sub), "not a snapshot")
            why = "a removal that was interrupted" if store.head(f"{sub}/{DELETING}") else "an upload in progress, or not ours"
            r["notes"].append(f"{name}: no {MANIFEST}: not a snapshot ({why})")
            reports[name] = r
    out = list(reports.values())
    names = {k.rsplit("/", 1)[-1] for k, _, _ in keys}
    for pointer in POINTERS:
        if pointer not in names:
            continue
        target, _ = read_pointer(store, pointer)
        r = _report(store.where(store.key(pointer)), "pointer")
        snap = reports.get(target or "")
        if snap is None or snap["kind"] != "snapshot":
            _fail(r, f"{pointer}: names {target!r}, which is not a snapshot under {store.where(base)}")
        elif not snap["ok"]:
            _fail(r, f"{pointer}: names {target}, which does not verify")
        else:
            r["notes"].append(f"{pointer} -> {target}")
        out.append(r)
    if not reports and not out:
        r = _report(store.where(base), "empty")
        _fail(r, "no snapshot and no pointer under this prefix")
        out.append(r)
    return out


def verify_s3(url: str, endpoint_url: Optional[str] = None, check_hashes: bool = True) -> List[dict]:
    """:func:`verify_url` of ``url`` with the AWS chain's credentials (and ``endpoint_url`` if given)."""
    from ...config.schema import PublishConfig

    try:
        store = Store(PublishConfig(url=url, endpoint_url=endpoint_url), retries=2)
        return verify_url(store, check_hashes)
    except StoreError as e:
        r = _report(url, "error")
        _fail(r, str(e))
        return [r]
