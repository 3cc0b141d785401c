"""Check a snapshot against its manifest and index: files, sizes, sha256, headers, tensors.

Reads headers with the bounds-checked reader of ``safetensors_io`` (never pickle).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from .commit import INDEX, MANIFEST
from .safetensors_io import SafetensorsFormatError, read_header, sha256_file


@dataclass
class VerifyReport:
    path: str
    ok: bool = True
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    errors: List[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.errors.append(msg)

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "files": self.files, "tensors": self.tensors, "bytes": self.bytes, "errors": self.errors}


def _load_json(path: Path, report: VerifyReport):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        report.fail(f"{path.name}: missing")
    except (ValueError, UnicodeDecodeError) as e:
        report.fail(f"{path.name}: not valid JSON ({e})")
    return None


def verify_snapshot(directory: "str | Path", check_hashes: bool = True) -> VerifyReport:
    d = Path(directory)
    report = VerifyReport(str(d))
    if not d.is_dir():
        report.fail(f"{d}: not a directory")
        return report
    manifest = _load_json(d / MANIFEST, report)
    if manifest is None:
        return report
    files = manifest.get("files")
    if not isinstance(files, dict):
        report.fail(f"{MANIFEST}: has no 'files' table")
        return report
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    if INDEX not in files and len(shards) == 1:
        # one file, no index (transformers' layout): the file's own header is the index
        try:
            _, entries, _ = read_header(d / shards[0])
            index = {"weight_map": {name: shards[0] for name in entries}}
        except (OSError, SafetensorsFormatError):
            index = {"weight_map": {}}  # the per-file checks below report the file
    else:
        index = _load_json(d / INDEX, report)
        if index is None:
            return report
    # every file the manifest lists: present, same size, same sha256
    for name, meta in sorted(files.items()):
        p = d / name
        if not p.is_file():
            report.fail(f"{name}: listed in the manifest but missing")
            continue
        size = p.stat().st_size
        report.files += 1
        report.bytes += size
        if size != meta.get("bytes"):
            report.fail(f"{name}: {size} bytes, the manifest says {meta.get('bytes')}")
            continue
        if check_hashes and sha256_file(p) != meta.get("sha256"):
            report.fail(f"{name}: sha256 differs from the manifest (the file was changed or damaged)")
    # every shard file on disk is listed
    for p in sorted(d.glob("*.safetensors")):
        if p.name not in files:
            report.fail(f"{p.name}: on disk but not in the manifest")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        report.fail(f"{INDEX}: has no 'weight_map'")
        return report
    # headers: well-formed, and exactly the tensors the index assigns to each file
    by_file = {}
    for tname, fname in weight_map.items():
        by_file.setdefault(fname, set()).add(tname)
    total_size = 0
    for fname in sorted(set(by_file) | {n for n in files if n.endswith(".safetensors")}):
        p = d / fname
        if not p.is_file():
            if fname in by_file and fname not in files:
                report.fail(f"{INDEX}: tensors {sorted(by_file[fname])[:3]} point to {fname}, which is missing")
            continue
        try:
            meta, entries, _ = read_header(p)
        except SafetensorsFormatError as e:
            report.fail(str(e))
            continue
        if meta is not None and not isinstance(meta, dict):
            report.fail(f"{fname}: __metadata__ is not an object")
        indexed = by_file.get(fname, set())
        for tname in sorted(indexed - set(entries)):
            report.fail(f"{INDEX}: tensor {tname!r} is indexed in {fname} but the file has no such tensor")
        for tname in sorted(set(entries) - indexed):
            report.fail(f"{fname}: tensor {tname!r} is not in {INDEX}")
        report.tensors += len(entries)
        total_size += sum(e.end - e.begin for e in entries.values())
    declared = (index.get("metadata") or {}).get("total_size")
    if declared is not None and declared != total_size and report.ok:
        report.fail(f"{INDEX}: metadata.total_size is {declared}, the files hold {total_size} tensor bytes")
    if manifest.get("num_tensors") is not None and manifest["num_tensors"] != report.tensors and report.ok:
        report.fail(f"{MANIFEST}: num_tensors is {manifest['num_tensors']}, the files hold {report.tensors}")
    return report
