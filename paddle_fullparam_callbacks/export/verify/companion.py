"""Check one companion of a snapshot (``<snapshot>/<directory>/``, e.g. its PEFT adapter) against the
manifest's ``model.companions`` table: every file it lists, with its size, checksum and (for safetensors) header.

The serving agent runs it before an engine loads a LoRA run's adapter: those few megabytes are all the engine
reads, so the snapshot's weights (gigabytes) need not be hashed for it.
"""
from __future__ import annotations

from pathlib import Path

from ..commit import MANIFEST
from .paths import SnapshotDir, Unreadable, describe_path, json_kind, name_problem
from .snapshot import VerifyReport, _check_file, _load_object, _manifest_files


def verify_companion(directory: "str | Path", companion: str, check_hashes: bool = True) -> VerifyReport:
    """Check ``<directory>/<companion>/`` against the snapshot's manifest; the report lists every problem.

    >>> verify_companion("/nonexistent", "adapter").errors
    ['/nonexistent/adapter: does not exist']
    """
    d = Path(directory)
    report = VerifyReport(str(d / companion))
    try:
        problem = describe_path(d) or name_problem(companion)
        if problem:
            raise Unreadable(problem)
        with SnapshotDir.open(d) as snap:
            manifest = _load_object(snap, MANIFEST, report)
            if manifest is None:
                return report.finish()
            model = manifest.get("model")
            table = (model.get("companions") if isinstance(model, dict) else None) or {}
            listed = table.get(companion) if isinstance(table, dict) else None
            if not isinstance(listed, dict) or not listed:
                report.fail(f"{MANIFEST}: model.companions lists no {companion!r} ("
                            f"{json_kind(listed) if listed is not None else 'absent'}): the snapshot was written "
                            "without it")
                return report.finish()
            files = _manifest_files({"files": listed}, report)
            with snap.child(companion) as sub:
                for name, expected in sorted(files.items()):
                    _check_file(sub, name, expected, report, check_hashes)
    except Unreadable as e:
        report.fail(f"{report.path}: {e}")
    return report.finish()
