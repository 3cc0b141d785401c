"""Never lose or overwrite what is not ours (issue 9): other people's files in and around
output_dir, the trainer's checkpoints, reruns, two writers, pointers in the way, callables
that cannot be imported, and a SIGTERM in the middle of an export."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from paddle_fullparam_callbacks import ConfigError, FullParamExportCallback, verify_snapshot
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.config import load_config
from paddle_fullparam_callbacks.export import ExportSession
from paddle_fullparam_callbacks.export.commit.lock import LOCK, OutputDirLocked
from paddle_fullparam_callbacks.models.model_info import build_model_source

from _helpers import ROOT, listing

pytestmark = pytest.mark.paddleformers


def _tree(path):
    """Every file under ``path`` with its bytes (to prove nothing of it changed)."""
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def _user_files(out):
    """Things a user (or another tool) keeps in output_dir, some under names like ours."""
    (out / ".tmp-other").mkdir(parents=True)
    (out / ".tmp-other" / "important.txt").write_text("mine")
    (out / ".trash-keep").mkdir()
    (out / ".trash-keep" / "notes.md").write_text("mine")
    (out / ".latest.backup").write_text("mine")
    (out / "hf-step-000004").mkdir()  # a snapshot's name, not a snapshot
    (out / "hf-step-000004" / "notes.txt").write_text("mine")
    return _tree(out)


def test_a_training_job_leaves_other_peoples_files_alone(tmp_path):
    out = tmp_path / "snaps"
    before = _user_files(out)
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out}", "trigger.every_n_steps=2"])
    args = trainer_args("paddleformers", str(tmp_path / "trainer"), 6, save_steps=100)
    make_trainer("paddleformers", make_tiny_llama(seed=0), args, [cb]).train()
    # step 4's name is taken by a directory that is not a snapshot: that export failed clearly
    # (on_error=warn: training went on), the others were committed
    assert cb.events == ["every_n_steps@2", "every_n_steps@4", "every_n_steps@6"]
    assert len(cb.errors) == 1 and "hf-step-000004' exists and is not a snapshot of this package" in cb.errors[0]
    after = _tree(out)
    assert {k: v for k, v in after.items() if k in before} == before  # every byte of theirs as it was
    assert listing(out) == [".latest.backup", ".tmp-other", ".trash-keep", "hf-step-000002", "hf-step-000004",
                            "hf-step-000006", "latest"]
    assert verify_snapshot(out / "hf-step-000006").ok


def test_snapshots_never_land_on_the_trainers_checkpoints(tmp_path):
    trainer_out = tmp_path / "trainer"
    args = trainer_args("paddleformers", str(trainer_out), 2, save_steps=1)
    make_trainer("paddleformers", make_tiny_llama(seed=0), args, []).train()
    before = _tree(trainer_out)
    for overrides, key in (([f"output_dir={trainer_out}", "export.name_template=checkpoint-{step}"], "export.name_template"),
                           ([f"output_dir={trainer_out / 'checkpoint-2' / 'hf'}"], "output_dir")):
        cb = FullParamExportCallback(None, overrides=overrides)
        trainer = make_trainer("paddleformers", make_tiny_llama(seed=1),
                               trainer_args("paddleformers", str(trainer_out), 2, save_steps=100), [cb])
        with pytest.raises(ConfigError, match=rf"^{key}: .*trainer"):
            trainer.train()
    after = _tree(trainer_out)
    assert {k: v for k, v in after.items() if k in before} == before


def _session(out, *overrides, resume=False):
    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out)
    session.start(resume=resume)
    return cfg, session


def test_a_second_run_into_the_same_directory_keeps_the_first_runs_snapshots(tmp_path):
    out = tmp_path / "snaps"
    first = make_tiny_llama(seed=1)
    cfg, session = _session(out, "retention.keep_last=3")
    for step in (100, 200, 300, 400, 500):
        session.export(build_model_source(first, cfg), step)
    session.close()
    kept = {n: (out / n / "model.safetensors").read_bytes() for n in ("hf-step-000300", "hf-step-000400", "hf-step-000500")}
    second = make_tiny_llama(seed=2)  # another seed: another run, not a resume
    cfg, session = _session(out, "retention.keep_last=3")
    for step in (100, 200):
        session.export(build_model_source(second, cfg), step)
    session.close()
    names = listing(out)
    assert names == ["hf-step-000100", "hf-step-000200", "hf-step-000300", "hf-step-000400", "hf-step-000500", "latest"]
    assert all((out / n / "model.safetensors").read_bytes() == b for n, b in kept.items())  # untouched
    assert (out / "latest").read_text().strip() == "hf-step-000200"  # this run's newest commit
    runs = {n: json.loads((out / n / "fullparam_manifest.json").read_text())["run"] for n in names[:-1]}
    assert runs["hf-step-000100"]["id"] == runs["hf-step-000200"]["id"] != runs["hf-step-000300"]["id"]
    assert [runs[n]["seq"] for n in ("hf-step-000100", "hf-step-000200")] == [1, 2]
    # its own retention counts only its commits: a third commit of this run removes nothing of the other
    cfg, session = _session(out, "retention.keep_last=2", resume=True)
    session.export(build_model_source(second, cfg), 250)
    assert listing(out) == ["hf-step-000200", "hf-step-000250", "hf-step-000300", "hf-step-000400",
                            "hf-step-000500", "latest"]


def test_two_writers_on_one_directory_are_refused_in_one_process(tmp_path):
    out = tmp_path / "snaps"
    a = FullParamExportCallback(None, overrides=[f"output_dir={out}"])
    b = FullParamExportCallback(None, overrides=[f"output_dir={out}"])
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0),
                           trainer_args("paddleformers", str(tmp_path / "t"), 2, save_steps=100), [a, b])
    with pytest.raises(OutputDirLocked, match=r"already used by another export session in this process"):
        trainer.train()


def test_a_pointer_in_the_way_is_refused_at_start_and_left_alone(tmp_path):
    out = tmp_path / "snaps"
    (out / "latest").mkdir(parents=True)
    (out / "latest" / "mine.txt").write_text("mine")
    with pytest.raises(OSError, match=r"latest' is a directory; this package keeps its 'latest' pointer there"):
        _session(out)
    assert (out / "latest" / "mine.txt").read_text() == "mine" and listing(out) == ["latest"]


def test_a_callable_that_cannot_be_imported_stops_the_job_at_start(tmp_path):
    for spec, message in (("no_such_mod:fn", r"'no_such_mod:fn' cannot be imported: ModuleNotFoundError"),
                          ("json:decoder", r"'json:decoder' is a module, not a function")):
        cb = FullParamExportCallback(None, overrides=["export.format=callable", f"export.callable={spec}"])
        trainer = make_trainer("paddleformers", make_tiny_llama(seed=0),
                               trainer_args("paddleformers", str(tmp_path / "t"), 2, save_steps=100), [cb])
        with pytest.raises(ConfigError, match=rf"^export.callable: {message}"):
            trainer.train()


@pytest.mark.parametrize("point", ["tensor@5", "manifest", "latest"])
def test_sigterm_during_an_export_releases_the_lock_and_hides_the_partial_snapshot(tmp_path, point):
    out = tmp_path / "snaps"
    job = [sys.executable, str(ROOT / "tests" / "faults" / "crash_job.py"), str(out)]
    env = {**os.environ, "PFC_FAULT_POINT": point, "PFC_FAULT_SIGNAL": "TERM", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]
    assert not (out / LOCK).exists()  # a restart anywhere can take the directory at once
    visible = [n for n in listing(out) if not n.startswith(".")]
    assert all(verify_snapshot(out / n).ok for n in visible if n.startswith("hf-"))
    env.pop("PFC_FAULT_POINT")
    proc = subprocess.run(job, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [n for n in listing(out) if n.startswith(".tmp-")]  # the leftover was ours and is gone
