"""Issue 9's hostile inputs, each run as a user or an adversary would, for ``make faults``.

For every case: the exact error (or verify report) it gives, whether that error is clear (one of
the package's own errors naming its cause, never a traceback of something else), and whether
anything that is not the package's own changed (a snapshot of the tree of other people's files
before and after). Prints one JSON object; ``crash_loop.py --long`` records it in
bench/results/faults.json.

    python tests/faults/hostile_inputs.py WORKDIR
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def tree(path: Path) -> dict:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = Path(p).read_bytes()
    return out


def foreign(path: Path) -> dict:
    """Other people's entries in an output dir (what the package must never touch)."""
    (path / ".tmp-other").mkdir(parents=True, exist_ok=True)
    (path / ".tmp-other" / "important.txt").write_text("mine")
    (path / ".trash-keep").mkdir(exist_ok=True)
    (path / ".trash-keep" / "notes.md").write_text("mine")
    (path / ".latest.backup").write_text("mine")
    (path / "README.txt").write_text("mine")
    return tree(path)


def touched(path: Path, before: dict) -> list:
    after = tree(path)
    return sorted(k for k, v in before.items() if after.get(k) != v)


def _model():
    from paddle_fullparam_callbacks.cli.demo import make_tiny_llama

    return make_tiny_llama(seed=0)


def _export(out: Path, *overrides, step=1, resume=False):
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out)
    try:
        session.start(resume=resume)
        return session.export(build_model_source(_model(), cfg), step)
    finally:
        session.close()


def _train(tmp: Path, callbacks, out_name="trainer", steps=2):
    from paddle_fullparam_callbacks.cli.demo import make_trainer, trainer_args

    args = trainer_args("paddleformers", str(tmp / out_name), steps, save_steps=1)
    make_trainer("paddleformers", _model(), args, callbacks).train()


# ---- the cases: each returns (error text or None, directory whose foreign files are watched) ---

def case_foreign_leftover_names(tmp):
    out = tmp / "out"
    _export(out)  # a whole job start, cleanup included
    return None, out


def _occupied(tmp, name):
    """A directory of the user's where the package would put ``name``; then an export."""
    out = tmp / "out"
    (out / name).mkdir(parents=True)
    (out / name / "mine.txt").write_text("mine")
    _export(out)
    return None, out


def case_non_snapshot_at_a_snapshot_name(tmp):
    return _occupied(tmp, "hf-step-000001")


def case_checkpoint_name_template(tmp):
    from paddle_fullparam_callbacks import FullParamExportCallback

    _train(tmp, [])
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp / 'trainer'}", "export.name_template=checkpoint-{step}"])
    _train(tmp, [cb])
    return None, tmp / "trainer"


def _template(template):
    def case(tmp):
        _export(tmp / "out", f"export.name_template={template}")
        return None, tmp / "out"
    case.__name__ = f"case_name_template {template}"
    return case


def case_rerun_into_the_same_directory(tmp):
    out = tmp / "out"
    for step in (100, 200, 300, 400, 500):
        _export(out, "retention.keep_last=3", step=step, resume=True)
    before = tree(out)
    kept = {k: v for k, v in before.items() if not k.startswith(("latest", "."))}
    _export(out, "retention.keep_last=3", step=100)  # a new run, step 100 is free (retention removed it)
    _export(out, "retention.keep_last=3", step=300)  # a new run onto the first run's step 300: refused
    changed = sorted(k for k, v in kept.items() if tree(out).get(k) != v)
    if changed:
        raise AssertionError(f"the first run's snapshots changed: {changed}")
    return None, out


def case_two_callbacks_one_directory(tmp):
    from paddle_fullparam_callbacks import FullParamExportCallback

    out = tmp / "out"
    _train(tmp, [FullParamExportCallback(output_dir=str(out)), FullParamExportCallback(output_dir=str(out))])
    return None, out


def case_callable_not_importable(tmp):
    from paddle_fullparam_callbacks import FullParamExportCallback

    cb = FullParamExportCallback(None, overrides=["export.format=callable", "export.callable=no_such_mod:fn"])
    _train(tmp, [cb])
    return None, tmp


def case_latest_is_a_directory(tmp):
    return _occupied(tmp, "latest")


def case_billion_laughs_recipe(tmp):
    from paddle_fullparam_callbacks.config import load_config

    lines = ['a0: &a0 ["lol"]'] + [f"a{i}: &a{i} [{', '.join(['*a%d' % (i - 1)] * 9)}]" for i in range(1, 10)]
    recipe = tmp / "laughs.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    try:
        load_config(str(recipe), [])
    finally:
        if time.perf_counter() - t0 > 5:
            raise AssertionError("the hostile recipe took more than 5 s")
    return None, tmp


def verify_cases():
    """verify on hostile snapshots: each must be DAMAGED with a reason, never a traceback."""
    def make(tmp):
        return _export(tmp / "out").path

    def escape(tmp):
        snap = make(tmp)
        m = json.loads((snap / "fullparam_manifest.json").read_text())
        m["files"]["../../etc/hostname"] = {"bytes": 1, "sha256": "0" * 64}
        (snap / "fullparam_manifest.json").write_text(json.dumps(m))
        return snap

    def symlink_shard(tmp):
        snap = make(tmp)
        shard = snap / "model.safetensors"
        outside = tmp / "outside.safetensors"
        os.replace(shard, outside)
        os.symlink(outside, shard)
        return snap

    def json_list(tmp):
        snap = make(tmp)
        (snap / "fullparam_manifest.json").write_text("[1, 2, 3]")
        return snap

    def deep(tmp):
        snap = make(tmp)
        (snap / "fullparam_manifest.json").write_text("[" * 200_000)
        return snap

    def missing(tmp):
        return tmp / "does-not-exist"

    return {"manifest path outside the snapshot": escape, "shard symlinked outside": symlink_shard,
            "manifest a JSON list": json_list, "200k nested [": deep, "missing path": missing}


def run(work: Path) -> dict:
    """Every case; the figures faults.json records."""
    from paddle_fullparam_callbacks.config import ConfigError
    from paddle_fullparam_callbacks.export import ExportError
    from paddle_fullparam_callbacks.export.commit.lock import OutputDirLocked
    from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot

    clear_types = (ConfigError, ExportError, OutputDirLocked, OSError)
    cases = [case_foreign_leftover_names, case_non_snapshot_at_a_snapshot_name, case_checkpoint_name_template,
             *[_template(t) for t in ("hf-{step:.0e}", "hf-{step:x}", "{step!r}", "{step:_}", "{step:0>300}")],
             case_rerun_into_the_same_directory, case_two_callbacks_one_directory, case_callable_not_importable,
             case_latest_is_a_directory, case_billion_laughs_recipe]
    rows, unclear, foreign_touched = [], 0, 0
    for i, case in enumerate(cases):
        tmp = work / f"case{i}"
        out = tmp / "out"
        before = foreign(out)
        error, clear = None, True
        try:
            case(tmp)
        except clear_types as e:
            error = f"{type(e).__name__}: {e}"
        except Exception as e:  # a traceback of something else: not a clear error
            error, clear = f"{type(e).__name__}: {e}", False
        changed = touched(out, before)
        unclear += not clear
        foreign_touched += len(changed)
        rows.append({"case": case.__name__.replace("case_", "").replace("_", " "), "error": error, "clear": clear,
                     "foreign_entries_touched": changed})
    for i, (name, make) in enumerate(verify_cases().items()):
        tmp = work / f"verify{i}"
        tmp.mkdir(parents=True)
        try:
            report = verify_snapshot(make(tmp))
            error, clear = "; ".join(report.errors), (not report.ok and bool(report.errors))
        except Exception as e:
            error, clear = f"traceback {type(e).__name__}: {e}", False
        unclear += not clear
        rows.append({"case": f"verify: {name}", "error": error[:500], "clear": clear, "foreign_entries_touched": []})
    return {"bad_inputs": len(rows), "bad_inputs_unclear": unclear, "foreign_entries_touched": foreign_touched,
            "cases": rows}


def sigterm_points(work: Path, points=("plan", "tensor@3", "finish", "manifest", "rename", "latest", "retention")) -> dict:
    """SIGTERM (a preemption) at named points of an export: locks left behind, partial snapshots visible."""
    locks_left, visible = 0, 0
    job = [sys.executable, str(ROOT / "tests" / "faults" / "crash_job.py")]
    for point in points:
        out = work / f"sigterm-{point.replace('@', '-')}"
        env = {**os.environ, "PFC_FAULT_POINT": point, "PFC_FAULT_SIGNAL": "TERM", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([*job, str(out)], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != -signal.SIGTERM:
            raise AssertionError(f"{point}: exit {proc.returncode}: {proc.stderr[-1000:]}")
        locks_left += (out / ".fullparam.lock").exists()
        visible += sum(1 for p in out.iterdir() if p.name.startswith("hf-") and not (p / "fullparam_manifest.json").is_file())
    return {"sigterm_points": len(points), "locks_left_after_sigterm": locks_left, "partial_visible_after_sigterm": visible}


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]))))
