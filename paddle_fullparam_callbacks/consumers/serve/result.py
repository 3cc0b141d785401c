"""From what the swap agent left to each engine's serve entry (pure but for reading its output)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Optional

from ..records import read_json as _json
from . import records
from .engines import Target

NO_RESULT = "the swap agent left no result (the job that ran it was killed, and the agent with it)"


def final_entries(running: dict, urls: Iterable[str], targets: Dict[str, Target], output: Path,
                  why: Optional[str] = None) -> Dict[str, dict]:
    """{url: final entry} of one snapshot's swap: the running entry, updated by the swap agent's result for
    that engine (its outcome, the version it serves now, each call's seconds, and ``served_s`` from the
    commit to the engine serving it); ``why``: why the agent gave no result, if it did not."""
    base = {k: v for k, v in running.items() if k not in ("status", "engines", "engine", "error", "engine_paths")}
    result = _json(output) or {}
    swaps = {s.get("url"): s for s in result.get("swaps") or [] if isinstance(s, dict)}
    if isinstance(result.get("verify_s"), (int, float)):
        base["verify_s"] = result["verify_s"]
    unverified = result.get("verified") is False
    out = {}
    for url in urls:
        entry = {**base, "engine": url}
        if url in targets:
            entry["engine_path"] = targets[url].path
        swap = swaps.get(url)
        if swap is None:
            error = ("the snapshot failed verification and is not offered to any engine: "
                     + "; ".join(map(str, result.get("verify_errors") or []))) if unverified else (
                result.get("error") or why or NO_RESULT)
            entry.update(status=records.FAILED, version=None, error=error)
            out[url] = entry
            continue
        seconds = swap.get("seconds") if isinstance(swap.get("seconds"), dict) else {}
        entry.update({k: v for k, v in seconds.items() if k.endswith("_s") or k in ("paused_unix", "resumed_unix")})
        entry.update(status=records.OK if swap.get("ok") else records.FAILED, version=swap.get("version"),
                     restored=bool(swap.get("restored")), left_paused=bool(swap.get("left_paused")))
        if swap.get("error"):
            entry["error"] = swap["error"]
        for key in ("loaded", "unloaded"):  # adapter mode: the names its adapter went under, those removed
            if isinstance(swap.get(key), list):
                entry[key] = swap[key]
        done, committed = seconds.get("done_unix"), running.get("committed_unix")
        if isinstance(done, (int, float)):
            entry["finished_unix"] = done
            if swap.get("ok") and isinstance(committed, (int, float)):
                entry["served_s"] = round(done - committed, 4)
        out[url] = entry
    return out
