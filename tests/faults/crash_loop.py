"""Crash loop: kill an exporting job (SIGKILL) at many points, restart, check the directory.

After every kill: nothing without a manifest is visible (every visible directory is a snapshot
that passes ``verify``), ``latest``/``best`` point at such snapshots, and every snapshot
committed before survives intact. The next run is the restart: it must clean the leftovers of
the crash and export normally. ``make faults`` runs the long version and writes
``bench/results/faults.json``; ``tests/test_pf_crash_loop.py`` runs a short one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot  # noqa: E402

POINTS = [
    "plan", "staging", "tensor@1", "tensor@3", "tensor@5", "block@1", "block@4", "block@7", "finish",
    "side_files", "manifest", "rename", "latest", "pointer@1", "pointer@2", "pointer@3", "best", "retention",
    "delete@1", "delete@2", "replace", "rename@3", "manifest@4", "tensor@20", "pointer@5",
]
LONG_EXTRA = ["tensor@2", "tensor@8", "tensor@13", "block@2", "block@11", "finish@2", "finish@3", "side_files@3",
              "latest@2", "latest@4", "best@2", "retention@3", "delete@3", "pointer@4", "pointer@7", "replace@2"]


def check(out: Path, before: dict) -> dict:
    """Invariants of an output directory after a crash. Returns counts of violations."""
    visible_partial, damaged = [], []
    names = {}
    if out.exists():
        for p in sorted(out.iterdir()):
            if p.name.startswith("."):
                continue  # staging / trash / lock: never a snapshot
            if p.is_dir():
                r = verify_snapshot(p)
                if not (p / "fullparam_manifest.json").exists():
                    visible_partial.append(p.name)
                elif not r.ok:
                    damaged.append(f"{p.name}: {r.errors[:2]}")
                else:
                    names[p.name] = json.loads((p / "fullparam_manifest.json").read_text())["files"]
        for ptr in ("latest", "best"):
            f = out / ptr
            if f.exists() and f.read_text().strip() not in names:
                visible_partial.append(f"{ptr} -> {f.read_text().strip()} (not a snapshot)")
    # every snapshot committed before the crash is intact (or was replaced/retired by a commit)
    for name, files in before.items():
        if name in names and names[name] != files and not _newer_commit(out / name):
            damaged.append(f"{name}: changed without a new commit")
    return {"partial": visible_partial, "damaged": damaged, "snapshots": names}


def _newer_commit(path: Path) -> bool:
    return (path / "fullparam_manifest.json").exists()


def run(points, out: Path, python: str = sys.executable, timeout: float = 300) -> dict:
    env = dict(os.environ)
    kills, not_reached, violations = [], [], []
    state = {}
    for point in points:
        env["PFC_FAULT_POINT"] = point
        proc = subprocess.run([python, str(HERE / "crash_job.py"), str(out)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode == -9:
            kills.append(point)
        elif proc.returncode == 0:
            not_reached.append(point)
        else:
            violations.append(f"{point}: exit {proc.returncode}: {proc.stderr[-800:]}")
        result = check(out, state)
        violations += [f"{point}: partial {x}" for x in result["partial"]] + [f"{point}: damaged {x}" for x in result["damaged"]]
        state = result["snapshots"]
    # the final restart: cleans every leftover and exports normally
    env.pop("PFC_FAULT_POINT")
    proc = subprocess.run([python, str(HERE / "crash_job.py"), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    final = check(out, state)
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".trash-", ".replaced-")))
    return {
        "kills": len(kills), "killed_at": kills, "not_reached": not_reached,
        "partial_snapshots_visible": sum(1 for v in violations if ": partial " in v) + len(final["partial"]),
        "committed_snapshots_damaged": sum(1 for v in violations if ": damaged " in v) + len(final["damaged"]),
        "violations": violations, "final_exit": proc.returncode, "final_stderr": proc.stderr[-800:] if proc.returncode else "",
        "leftovers_after_restart": leftovers, "final_snapshots": sorted(final["snapshots"]),
    }


# (point, rank to kill): the coordinator's commit steps, and any rank's assembly and writing
RANK_POINTS = [
    ("staging", 2), ("tensor@1", 1), ("tensor@3", 3), ("block@2", 2), ("finish", 1), ("side_files", 0),
    ("manifest", 0), ("rename", 0), ("latest", 0), ("pointer@1", 0), ("delete@1", 0), ("plan@2", 3),
]


def run_ranks(points, out: Path, timeout: float = 240) -> dict:
    """The crash loop on 4 launched ranks (dp2 x mp2): one rank is killed, the launcher stops the
    job; each next launch is the restart."""
    sys.path.insert(0, str(ROOT / "tests" / "multirank"))
    import harness

    kills, not_reached, violations, state = [], [], [], {}
    env = dict(os.environ)
    for point, rank in points:
        env.update(PFC_FAULT_POINT=point, PFC_FAULT_RANK=str(rank))
        res = harness.run_launch(HERE / "crash_job_ranks.py", [out], nproc=4, timeout=timeout, env=env)
        done = sum("DONE" in log for log in res.logs.values())
        if res.timed_out:
            violations.append(f"{point}@rank{rank}: hang (timed out after {timeout} s)")
        elif res.rc != 0 and done < 4:
            kills.append(f"{point}@rank{rank}")
        elif res.rc == 0:
            not_reached.append(f"{point}@rank{rank}")
        result = check(out, state)
        violations += [f"{point}@rank{rank}: partial {x}" for x in result["partial"]]
        violations += [f"{point}@rank{rank}: damaged {x}" for x in result["damaged"]]
        state = result["snapshots"]
    env.pop("PFC_FAULT_POINT")
    env.pop("PFC_FAULT_RANK")
    res = harness.run_launch(HERE / "crash_job_ranks.py", [out], nproc=4, timeout=timeout, env=env)
    final = check(out, state)
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith((".tmp-", ".trash-", ".replaced-")))
    return {
        "kills": len(kills), "killed_at": kills, "not_reached": not_reached, "violations": violations,
        "partial_snapshots_visible": sum(1 for v in violations if ": partial " in v) + len(final["partial"]),
        "committed_snapshots_damaged": sum(1 for v in violations if ": damaged " in v) + len(final["damaged"]),
        "final_exit": res.rc, "leftovers_after_restart": leftovers, "final_snapshots": sorted(final["snapshots"]),
    }


def main():
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--long", action="store_true")
    ns = ap.parse_args()
    points = POINTS + (LONG_EXTRA if ns.long else [])
    with tempfile.TemporaryDirectory(prefix="pfc_crash_") as d:
        stats = run(points, Path(d) / "out")
        ranks = run_ranks(RANK_POINTS if ns.long else RANK_POINTS[:3], Path(d) / "out4")
    bad = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests/unit/test_config.py::test_bad_config_names_the_key"),
                          str(ROOT / "tests/unit/test_config.py::test_parse_size_bad"),
                          str(ROOT / "tests/unit/test_config.py::test_nonexistent_recipe_name"),
                          str(ROOT / "tests/test_pf_bad_inputs.py")], capture_output=True, text=True, cwd=ROOT)
    import re

    m = re.search(r"(\d+) passed", bad.stdout)
    f = re.search(r"(\d+) failed", bad.stdout)
    result = {
        "kills": stats["kills"] + ranks["kills"],
        "partial_snapshots_visible": stats["partial_snapshots_visible"] + ranks["partial_snapshots_visible"],
        "committed_snapshots_damaged": stats["committed_snapshots_damaged"] + ranks["committed_snapshots_damaged"],
        "bad_inputs": int(m.group(1)) + (int(f.group(1)) if f else 0) if m else 0,
        "bad_inputs_unclear": int(f.group(1)) if f else 0,
        "single_process": {k: stats[k] for k in ("kills", "killed_at", "not_reached", "violations", "final_exit",
                                                  "leftovers_after_restart")},
        "four_ranks": {k: ranks[k] for k in ("kills", "killed_at", "not_reached", "violations", "final_exit",
                                              "leftovers_after_restart")},
        "notes": ["single process: plain-Paddle toy model; 4 ranks: dp2 x mp2 launch with real parallel layers; "
                  "SIGKILL at named points (PFC_FAULT_POINT, PFC_FAULT_RANK); each next run is the restart"],
    }
    # issue 9: hostile inputs (other people's files, names, reruns, writers, verify), SIGTERM, a stall
    import hostile_inputs

    sys.path.insert(0, str(ROOT / "tests" / "multirank"))
    sys.path.insert(0, str(ROOT / "tests"))
    with tempfile.TemporaryDirectory(prefix="pfc_hostile_") as d:
        hostile = hostile_inputs.run(Path(d) / "cases")
        sigterm = hostile_inputs.sigterm_points(Path(d))
        from test_pf_multirank import STALL_TIMEOUT_S, run_stalled_export

        stall_res, stall_s = run_stalled_export(Path(d) / "stall")
        fuzz_out = Path(d) / "verify_fuzz.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "verify_fuzz.py"), "--out", str(fuzz_out)],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        fuzz_figures = json.loads(fuzz_out.read_text()) if fuzz_out.exists() else {}
    # issue 18: real filesystems (tmpfs size=, loop ext4): a full disk at each write, quota, read-only, removal
    import disk_points

    disk = disk_points.run(ns.long)
    result["disk"] = {**disk_points.summary(disk), "cases": disk}
    result["bad_inputs"] += hostile["bad_inputs"]
    result["bad_inputs_unclear"] += hostile["bad_inputs_unclear"]
    result.update(
        foreign_entries_touched=hostile["foreign_entries_touched"],
        verify_fuzz_cases=fuzz_figures.get("verify_fuzz_cases"),
        verify_fuzz_tracebacks=fuzz_figures.get("verify_fuzz_tracebacks"),
        verify_fuzz_reads_outside=fuzz_figures.get("verify_fuzz_escapes"),
        sigterm_points=sigterm["sigterm_points"], locks_left_after_sigterm=sigterm["locks_left_after_sigterm"],
        partial_visible_after_sigterm=sigterm["partial_visible_after_sigterm"],
        stall_exit_seconds=round(stall_s, 1), stall_timeout_s=STALL_TIMEOUT_S,
        stall_named_the_stopped_rank=all("waiting for rank(s) [3]" in stall_res.logs.get(r, "") for r in (0, 1, 2)),
        hostile_inputs=hostile["cases"],
    )
    result["notes"].append("hostile inputs: tests/faults/hostile_inputs.py (each case's exact error; other people's "
                           "files compared byte for byte before and after); SIGTERM at named points of an export; "
                           "a 4-rank export with one rank SIGSTOPped and export.timeout_s=5")
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "faults.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({**{k: result[k] for k in ("kills", "partial_snapshots_visible", "committed_snapshots_damaged",
                                                 "bad_inputs", "bad_inputs_unclear", "foreign_entries_touched",
                                                 "verify_fuzz_cases", "verify_fuzz_tracebacks", "sigterm_points",
                                                 "locks_left_after_sigterm", "stall_exit_seconds")},
                      "disk_points": result["disk"].get("disk_points"),
                      "disk_points_leaving_something": result["disk"].get("disk_points_leaving_something")}))
    ok = (result["partial_snapshots_visible"] == 0 and result["committed_snapshots_damaged"] == 0
          and result["bad_inputs_unclear"] == 0 and stats["final_exit"] == 0 and not stats["leftovers_after_restart"]
          and result["foreign_entries_touched"] == 0 and result["locks_left_after_sigterm"] == 0
          and result["verify_fuzz_tracebacks"] == 0 and result["verify_fuzz_reads_outside"] == 0
          and ranks["final_exit"] == 0 and not ranks["leftovers_after_restart"] and not ranks["violations"]
          and not result["disk"].get("disk_points_leaving_something") and not result["disk"].get("disk_points_without_error"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
