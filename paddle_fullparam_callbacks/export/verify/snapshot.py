"""Check a snapshot against its manifest and index: files, sizes, checksums, headers, tensors.

Everything read is untrusted and every flaw is reported, never raised: names from the manifest
and the index must be plain file names and are opened through ``paths`` (never outside
the snapshot, never through a symbolic link); values of the wrong type are named with their
key. Headers are read with the bounds-checked reader of ``write.header`` (never pickle).
Output directories (snapshots plus ``latest``/``best``) are checked by ``tree``; an FP8 snapshot's layout
(scales, shapes, config.json) by ``quantized``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..commit import INDEX, MANIFEST
from ..write.header import SafetensorsFormatError, parse_header, short
from ..write import checksum
from .paths import SnapshotDir, Unreadable, describe_path, json_kind, label, name_problem
from .fp8_blocks import check_blocks
from .quantized import check_fp8

MAX_ERRORS = 100  # per report; a damaged index can name every tensor
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


@dataclass
class VerifyReport:
    path: str
    ok: bool = True
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    errors: List[str] = field(default_factory=list)
    more_errors: int = 0

    def fail(self, msg: str) -> None:
        self.ok = False
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(msg)
        else:
            self.more_errors += 1

    def finish(self) -> "VerifyReport":
        if self.more_errors:
            self.errors.append(f"... and {self.more_errors} more errors")
            self.more_errors = 0
        return self

    def as_dict(self) -> dict:
        return {"path": self.path, "kind": "snapshot", "ok": self.ok, "files": self.files, "tensors": self.tensors,
                "bytes": self.bytes, "errors": self.errors}


def verify_snapshot(directory: "str | Path", check_hashes: bool = True, mapped: bool = False) -> VerifyReport:
    """Check the snapshot ``directory``; the report lists every problem found (``ok`` if none). ``mapped``:
    checksums through memory maps on every core (``checksum.digest_of_mapped``: the serving agent's way).

    >>> verify_snapshot("/nonexistent").errors
    ['/nonexistent: does not exist']
    """
    d = Path(directory)
    report = VerifyReport(str(d))
    try:
        problem = describe_path(d)
        if problem:
            raise Unreadable(problem)
        with SnapshotDir.open(d) as snap:
            return check_open_snapshot(snap, report, check_hashes, mapped)
    except Unreadable as e:
        report.fail(f"{d}: {e}")
        return report


def check_open_snapshot(snap: SnapshotDir, report: VerifyReport, check_hashes: bool = True,
                        mapped: bool = False) -> VerifyReport:
    """The checks of :func:`verify_snapshot` on an open directory, recorded in ``report``."""
    try:
        _check(snap, report, check_hashes, mapped)
    except Unreadable as e:  # the directory itself failed midway (removed, permissions changed)
        report.fail(f"{snap.path}: {e}")
    return report.finish()


Expected = Tuple[Optional[int], Optional[Tuple[str, str]]]  # (bytes, (algorithm, digest)); None where unusable


def _check(snap: SnapshotDir, report: VerifyReport, check_hashes: bool, mapped: bool = False) -> None:
    manifest = _load_object(snap, MANIFEST, report)
    files = None if manifest is None else _manifest_files(manifest, report)
    if files is None:
        return
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    single = INDEX not in files and len(shards) == 1  # transformers' layout: the header is the index
    index = None if single else _load_index(snap, files, shards, report)
    headers, starts = {}, {}
    for name, expected in sorted(files.items()):
        found = _check_file(snap, name, expected, report, check_hashes, mapped)
        if found is not None:
            headers[name], starts[name] = found
    for name in snap.names():
        if name.endswith(".safetensors") and name not in files:
            kind = snap.kind_problem(name)
            report.fail(f"{label(name)}: on disk but not in the manifest" + (f"; it {kind}" if kind and kind != "missing" else ""))
    if single and shards[0] in headers:
        index = ({t: shards[0] for t in headers[shards[0]]}, None)
    if index is not None:
        total = _check_tensors(index[0], headers, files, report)
        _check_totals(manifest, index[1], total, report)
    fp8 = check_fp8(snap, {n: e for entries in headers.values() for n, e in entries.items()}, report)
    if fp8 is not None and check_hashes:  # the bytes themselves, read as the checksums are
        located = {n: (f, starts[f], e) for f, entries in headers.items() for n, e in entries.items()}
        check_blocks(snap, located, fp8[1], fp8[0], report)


def _load_object(snap: SnapshotDir, name: str, report: VerifyReport) -> Optional[dict]:
    try:
        obj = snap.read_json(name)
    except Unreadable as e:
        report.fail(f"{name}: {e}")
        return None
    if not isinstance(obj, dict):
        report.fail(f"{name}: is {json_kind(obj)}, not an object")
        return None
    return obj


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _value(meta: dict, key: str) -> str:
    return f"is {short(meta[key])}" if key in meta else "is missing"


def _manifest_files(manifest: dict, report: VerifyReport) -> Optional[Dict[str, Expected]]:
    """The manifest's ``files`` table with its names checked: {name: (bytes, (algorithm, digest))}
    (BLAKE3 since 0.1.0, SHA-256 before: each entry is keyed by its algorithm)."""
    files = manifest.get("files")
    if files is None:
        report.fail(f"{MANIFEST}: has no 'files' table")
        return None
    if not isinstance(files, dict):
        report.fail(f"{MANIFEST}: files: is {json_kind(files)}, not an object")
        return None
    out: Dict[str, Expected] = {}
    for name, meta in files.items():
        problem = name_problem(name)
        if problem:
            report.fail(f"{MANIFEST}: files: {problem}")
            continue
        where = f"{MANIFEST}: files[{short(name)}]"
        if not isinstance(meta, dict):
            report.fail(f"{where}: is {json_kind(meta)}, not an object with 'bytes' and a checksum "
                        f"({' or '.join(checksum.ALGORITHMS)})")
            out[name] = (None, None)
            continue
        size = meta.get("bytes")
        if not _is_count(size):
            report.fail(f"{where}.bytes: {_value(meta, 'bytes')}, not a whole number >= 0")
            size = None
        algorithm = next((a for a in checksum.ALGORITHMS if a in meta), "sha256")
        digest = meta.get(algorithm)
        if not (isinstance(digest, str) and _SHA256.fullmatch(digest)):
            report.fail(f"{where}.{algorithm}: {_value(meta, algorithm)}, not 64 hex digits")
            digest = None
        digest = (algorithm, digest) if digest is not None else None
        out[name] = (size, digest)
    return out


def _load_index(snap, files, shards, report) -> Optional[Tuple[Dict[str, str], Optional[int]]]:
    """The index's weight map with its file names checked, and its metadata.total_size."""
    if not shards:
        report.fail(f"{MANIFEST}: files: lists no .safetensors file")
        return None
    if INDEX not in files:
        report.fail(f"{INDEX}: not listed in the manifest (a snapshot of {len(shards)} files needs one)")
        return None
    index = _load_object(snap, INDEX, report)
    if index is None:
        return None
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        report.fail(f"{INDEX}: has no 'weight_map'" if weight_map is None else
                    f"{INDEX}: weight_map: is {json_kind(weight_map)}, not an object")
        return None
    out = {}
    for tensor, fname in weight_map.items():
        problem = name_problem(fname)
        if problem:
            report.fail(f"{INDEX}: weight_map[{short(tensor)}]: {problem}")
        else:
            out[tensor] = fname
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        report.fail(f"{INDEX}: metadata: is {json_kind(metadata)}, not an object")
        return out, None
    declared = metadata.get("total_size")
    if declared is not None and not _is_count(declared):
        report.fail(f"{INDEX}: metadata.total_size: is {short(declared)}, not a whole number >= 0")
        declared = None
    return out, declared


def _digest(f, algorithm: str, mapped: bool = False) -> str:
    """The file's digest from its start; a checksum this environment cannot compute is reported as such."""
    f.seek(0)
    try:
        return checksum.digest_of_mapped(f, algorithm) if mapped else checksum.digest_of_stream(f, algorithm)
    except ValueError as e:
        return f"cannot be computed here: {e}"


def _check_file(snap, name: str, expected: Expected, report: VerifyReport, check_hashes: bool,
                mapped: bool = False) -> Optional[Tuple[dict, int]]:
    """Size and checksum of one listed file; for a shard, its header entries and where its data starts (None if
    unreadable)."""
    size_expected, digest = expected
    name_ = label(name)
    try:
        f = snap.open_file(name)
    except Unreadable as e:
        report.fail(f"{name_}: listed in the manifest but missing" if str(e) == "missing" else f"{name_}: {e}")
        return None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            report.files += 1
            report.bytes += size
            if size_expected is not None and size != size_expected:
                report.fail(f"{name_}: {size} bytes, the manifest says {size_expected}")
            elif check_hashes and digest is not None and _digest(f, digest[0], mapped) != digest[1].lower():
                report.fail(f"{name_}: {digest[0]} differs from the manifest (the file was changed or damaged)")
            if not name.endswith(".safetensors"):
                return None
            metadata, entries, data_start = parse_header(f, name_)
    except SafetensorsFormatError as e:
        report.fail(str(e))
        return None
    except OSError as e:
        report.fail(f"{name_}: cannot be read ({e.strerror or e})")
        return None
    if metadata is not None and not isinstance(metadata, dict):
        report.fail(f"{name_}: __metadata__ is {json_kind(metadata)}, not an object")
    return entries, data_start


def _check_tensors(weight_map: Dict[str, str], headers: dict, files: dict, report: VerifyReport) -> int:
    """Each indexed tensor is in the file the index names, each tensor of a file is indexed there."""
    by_file: Dict[str, set] = {}
    for tensor, fname in weight_map.items():
        by_file.setdefault(fname, set()).add(tensor)
    for fname, tensors in sorted(by_file.items()):
        some = [short(t) for t in sorted(tensors)[:3]]
        if fname not in files:
            report.fail(f"{INDEX}: tensors {', '.join(some)} point to {short(fname)}, which the manifest does not list")
        elif not fname.endswith(".safetensors"):
            report.fail(f"{INDEX}: tensors {', '.join(some)} point to {short(fname)}, which is not a .safetensors file")
    total = 0
    for fname, entries in sorted(headers.items()):
        indexed = by_file.get(fname, set())
        for tensor in sorted(indexed - set(entries)):
            report.fail(f"{INDEX}: tensor {short(tensor)} is indexed in {label(fname)} but the file has no such tensor")
        for tensor in sorted(set(entries) - indexed):
            report.fail(f"{label(fname)}: tensor {short(tensor)} is not in {INDEX}")
        report.tensors += len(entries)
        total += sum(e.end - e.begin for e in entries.values())
    return total


def _check_totals(manifest: dict, declared: Optional[int], total: int, report: VerifyReport) -> None:
    """Counts that only mean something once everything else agrees."""
    if declared is not None and declared != total and report.ok:
        report.fail(f"{INDEX}: metadata.total_size is {declared}, the files hold {total} tensor bytes")
    n = manifest.get("num_tensors")
    if n is not None and not _is_count(n):
        report.fail(f"{MANIFEST}: num_tensors: is {short(n)}, not a whole number >= 0")
    elif n is not None and n != report.tensors and report.ok:
        report.fail(f"{MANIFEST}: num_tensors is {n}, the files hold {report.tensors}")
