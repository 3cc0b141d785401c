"""Real-disk fault points for ``make faults``: a full disk at each write of an export, on a tmpfs
with ``size=`` and on a loop-mounted ext4 image, plus a quota error (simulated: root is not bound
by quotas), a read-only remount and the output directory removed between and during exports.

For each point: the error every export raised, and what it left behind (entries in the output
directory, descriptors of this process into it, free bytes not given back). Needs root to mount;
elsewhere it reports that it could not run.

    python tests/faults/disk_points.py [--long]      # prints the JSON that crash_loop.py records
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PHASES = ["staging", "tensor", "side_files", "config", "manifest", "pointer_tmp"]
LONG_PHASES = ["tensor@3", "block@2", "block@5", "finish"]


def _session(model, out):
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=150KB"])
    session = ExportSession(cfg, out)
    session.start()
    return session, build_model_source(model, cfg)


def _case(session, source, step, out, fs, act, undo=lambda: None) -> dict:
    """Run one export with ``act`` armed; what it raised and what it left."""
    from _filesystems import descriptors_into, free_bytes, listing

    from paddle_fullparam_callbacks.export import ExportError

    before, free = listing(out), free_bytes(fs)
    error = None
    try:
        act()
        session.export(source, step)
    except ExportError as e:
        error = str(e)
    finally:
        undo()
    return {"error": error, "left_entries": sorted(set(listing(out)) - set(before)),
            "lost_entries": sorted(set(before) - set(listing(out))),
            "descriptors": descriptors_into(out), "bytes_not_back": free - free_bytes(fs)}


def _full_disk(kind: str, phases, work: Path, model) -> dict:
    from _filesystems import fill, mounted

    from paddle_fullparam_callbacks import _faults

    out = {}
    with mounted(kind, work / kind) as fs:
        snaps = fs / "snaps"
        session, source = _session(model, snaps)
        session.export(source, 1)
        for i, phase in enumerate(phases):
            name, _, nth = phase.partition("@")
            state = {"n": 0, "filler": None}

            def hook(point, name=name, nth=int(nth or 1), state=state):
                if point == name:
                    state["n"] += 1
                    if state["n"] == nth and state["filler"] is None:
                        state["filler"] = fill(fs)

            def arm(hook=hook):
                _faults.HOOK = hook

            def disarm(state=state):
                _faults.HOOK = None
                if state["filler"] is not None:
                    state["filler"].unlink()

            r = _case(session, source, 10 + i, snaps, fs, arm, disarm)
            r["reached"] = state["filler"] is not None
            out[phase] = r
        out["next_export_ok"] = session.export(source, 99).path is not None
        session.close()
    return out


def run(long: bool = False) -> dict:
    from _filesystems import mounted, remount

    from paddle_fullparam_callbacks import _faults
    from paddle_fullparam_callbacks.cli.demo import make_tiny_llama
    from paddle_fullparam_callbacks.export.write import writer

    if os.geteuid() != 0:
        return {"could_not_run": "not root: mounting tmpfs and ext4 images needs root (CI runs as root)"}
    model = make_tiny_llama(seed=3)
    phases = PHASES + (LONG_PHASES if long else [])
    result = {}
    with tempfile.TemporaryDirectory(prefix="pfc_disk_") as d:
        work = Path(d)
        for kind in ("tmpfs", "ext4"):
            result[f"full_{kind}"] = _full_disk(kind, phases, work, model)
        with mounted("ext4", work / "other") as fs:
            snaps = fs / "snaps"
            session, source = _session(model, snaps)
            session.export(source, 1)
            real = writer._pwrite_all

            def over_quota(fd, data, offset):
                raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

            result["quota_simulated"] = _case(session, source, 2, snaps, fs,
                                              lambda: setattr(writer, "_pwrite_all", over_quota),
                                              lambda: setattr(writer, "_pwrite_all", real))
            result["read_only_remount"] = _case(session, source, 3, snaps, fs, lambda: remount(fs, "ro"),
                                                lambda: remount(fs, "rw"))
            result["removed_between_exports"] = _case(session, source, 4, snaps, fs, lambda: shutil.rmtree(snaps))
            result["removed_during_export"] = _case(
                session, source, 5, snaps, fs,
                lambda: setattr(_faults, "HOOK", lambda p: shutil.rmtree(snaps) if p == "tensor" and snaps.exists()
                                else None),
                lambda: setattr(_faults, "HOOK", None))
            result["after_all"] = {"export_ok": session.export(source, 6).path is not None}
            session.close()
    return result


def summary(result: dict) -> dict:
    """Counts for faults.json: points run, and how many left anything behind or said nothing."""
    if "could_not_run" in result:
        return {"disk_points": 0, "disk_points_could_not_run": result["could_not_run"]}
    cases = [(f"{k}:{p}", r) for k, v in result.items() if k.startswith("full_")
             for p, r in v.items() if isinstance(r, dict)]
    cases += [(k, v) for k, v in result.items() if not k.startswith("full_") and k != "after_all"]
    # a removed output_dir is made again with this job's lock (its other entries went with it)
    allowed = {n: ([".fullparam.lock"] if n.startswith("removed") else []) for n, _ in cases}
    leaks = [n for n, r in cases if set(r["left_entries"]) - set(allowed[n]) or r["descriptors"]
             or (r["bytes_not_back"] and not n.startswith("removed"))
             or (r["lost_entries"] and not n.startswith("removed"))]
    silent = [n for n, r in cases if not r["error"]]
    return {"disk_points": len(cases), "disk_points_leaving_something": leaks, "disk_points_without_error": silent,
            "disk_points_not_reached": [n for n, r in cases if r.get("reached") is False]}


if __name__ == "__main__":
    res = run("--long" in sys.argv)
    print(json.dumps({"summary": summary(res), "cases": res}, indent=1))
