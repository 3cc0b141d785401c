"""How ``paddle-fullparam verify`` shows its reports: text lines, or one JSON object.

One path gives its report's object (a snapshot's keeps the shape it always had); several give
``{"ok": ..., "snapshots": [one object per path]}``. Each object has a ``kind``: ``snapshot``,
``output_dir`` (its ``snapshots``, ``pointers`` and ``skipped`` entries) or ``pointer``.
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List

from .paths import label
from .snapshot import VerifyReport
from .tree import OutputDirReport, PointerReport, Report


def snapshot_reports(reports: List[Report]) -> Iterator[VerifyReport]:
    """Every snapshot report, those inside output directories included, each once."""
    seen = set()
    for r in reports:
        for s in r.snapshots if isinstance(r, OutputDirReport) else [r] if isinstance(r, VerifyReport) else []:
            if id(s) not in seen:
                seen.add(id(s))
                yield s


def add_transformers(reports: List[Report]) -> Dict[int, dict]:
    """Run ``verify --transformers`` on every snapshot whose files verified; {id(report): its dict}.

    A damaged snapshot is not handed to transformers: its files may be links or garbage.
    """
    from .hf import verify_with_transformers

    out = {}
    for r in snapshot_reports(reports):
        if not r.ok:
            out[id(r)] = {"ok": False, "skipped": "the snapshot's files did not verify"}
            continue
        hf = verify_with_transformers(r.path)
        out[id(r)] = hf.as_dict()
        if not hf.ok:
            for problem in hf.problems():
                r.fail(f"transformers: {problem}")
    return out


def payload(r: Report, hf: Dict[int, dict]) -> dict:
    """The JSON object of one report (``transformers`` added to the snapshots that have one)."""
    d = r.as_dict()
    pairs = zip(r.snapshots, d["snapshots"]) if isinstance(r, OutputDirReport) else [(r, d)]
    for s, sd in pairs:
        if id(s) in hf:
            sd["transformers"] = hf[id(s)]
    return d


def combined(reports: List[Report], hf: Dict[int, dict]) -> dict:
    if len(reports) == 1:
        return payload(reports[0], hf)
    return {"ok": all(r.ok for r in reports), "snapshots": [payload(r, hf) for r in reports]}


def text_lines(r: Report) -> Iterator[str]:
    """The report as the lines the command prints."""
    status = "OK" if r.ok else "DAMAGED"
    if isinstance(r, VerifyReport):
        counts = f": {r.files} files, {r.tensors} tensors, {r.bytes} bytes" if r.ok or r.files else ""
        yield f"{status}  {r.path}{counts}"
    elif isinstance(r, PointerReport):
        yield f"{status}  {r.path} -> {r.target if r.target is not None else '?'}"
    else:
        for s in r.snapshots:
            yield from text_lines(s)
        for p in r.pointers:
            yield from text_lines(p)
        for name, why in r.skipped:
            yield f"SKIPPED  {os.path.join(r.path, label(name))}: {why}"
        bad = sum(not s.ok for s in r.snapshots)
        yield (f"{status}  {r.path}: output directory, {len(r.snapshots)} snapshot(s) ({bad} damaged), "
               f"{len(r.pointers)} pointer(s), {len(r.skipped)} entr{'y' if len(r.skipped) == 1 else 'ies'} skipped")
    for e in r.errors:
        yield f"  - {e}"
