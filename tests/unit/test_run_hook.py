"""The startup hook's rules (trainer/autoattach), against a fake framework with the real one's shape
(tests/run/fake_framework.py), in fresh processes as a user's job would start them: exactly one
FullParamExportCallback per Trainer whatever the order the user's own arrives in, the checkpoint hook
going with the callback that stays, refusals at construction naming the class, the version or the
variable, nothing at all without ``PADDLE_FULLPARAM_RECIPE``, and the records ``run`` reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "run"))

from fake_framework import write_fake  # noqa: E402

from paddle_fullparam_callbacks.trainer.autoattach import records  # noqa: E402

SITEDIR = ROOT / "paddle_fullparam_callbacks" / "trainer" / "autoattach" / "sitedir"
PROBE = ROOT / "tests" / "run" / "hook_probe.py"
OWN_SCENARIOS = ["in_constructor", "subclass_adds_after_init", "add_callback_after_construction",
                 "attach_after_construction"]


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    base = tmp_path_factory.mktemp("fakes")
    return {(fw, v): write_fake(base / f"{fw}-{v}", fw, v)
            for fw, v in [("paddleformers", "1.2.0"), ("paddlenlp", "2.8.1"), ("paddleformers", "9.0.0")]}


def _env(fake: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SITEDIR), str(fake), str(ROOT)])
    env.update(extra)
    return env


def _probe(fake: Path, framework: str, scenarios, cwd, **env) -> dict:
    proc = subprocess.run([sys.executable, str(PROBE), framework, *scenarios], env=_env(fake, **env), cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    return {r["scenario"]: r for r in rows}


@pytest.mark.parametrize("framework,version", [("paddleformers", "1.2.0"), ("paddlenlp", "2.8.1")])
def test_every_trainer_ends_with_exactly_one_callback(fakes, tmp_path, framework, version):
    run_dir = tmp_path / "records"
    run_dir.mkdir()
    got = _probe(fakes[framework, version], framework, ["plain", "deep_subclass", "two_trainers", *OWN_SCENARIOS],
                 tmp_path, PADDLE_FULLPARAM_RECIPE="hf_every_n_steps", PADDLE_FULLPARAM_OVERRIDES="trigger.every_n_steps=3",
                 PADDLE_FULLPARAM_RUN_DIR=str(run_dir))
    for name in ("plain", "deep_subclass", "two_trainers"):
        r = got[name]
        assert r["fullparam"] == ["auto"] and r["recipe_of_auto"] == 3, r  # the recipe and its overrides
        assert len(r["log"]) == (2 if name == "two_trainers" else 1), r  # one line per Trainer
        for line in r["log"]:
            assert "FullParamExportCallback attached (recipe hf_every_n_steps, overrides trigger.every_n_steps=3); " \
                "snapshots in " in line, r
            assert line.endswith(str(tmp_path / "fake_out" / "fullparam")), r  # the trainer's output_dir/fullparam
        assert r["init_state_left"] == [] and r["hook_loaded"], r
    assert got["deep_subclass"]["log"][0].startswith("Outer: "), got["deep_subclass"]  # the outermost class, once
    for name in OWN_SCENARIOS:
        r = got[name]
        assert r["fullparam"] == ["own"], r
        assert r["log"] == [f"{'AddsAfterInit' if name == 'subclass_adds_after_init' else 'Trainer'} already has a "
                            "FullParamExportCallback: it keeps its own; PADDLE_FULLPARAM_RECIPE adds none"], r
    # what run reads: one record per Trainer built (two_trainers built two), with its outcome
    rows = records.read_all(run_dir)
    states = sorted(r["state"] for r in rows)
    assert states == sorted(["attached"] * 4 + ["own"] * len(OWN_SCENARIOS)), rows
    assert {r["framework"] for r in rows} == {framework} and {r["version"] for r in rows} == {version}
    lines = records.summary(rows)
    assert any(ln.endswith("had its own FullParamExportCallback, kept it (the wrapper added none)") for ln in lines)
    assert any("FullParamExportCallback attached; snapshots in " in ln and "(0 committed)" in ln for ln in lines)


def test_the_checkpoint_hook_goes_with_the_callback_that_stays(fakes, tmp_path):
    got = _probe(fakes["paddleformers", "1.2.0"], "paddleformers", ["plain", "attach_after_first_event"], tmp_path,
                 PADDLE_FULLPARAM_RECIPE="checkpoint_hook")
    assert got["plain"]["fullparam"] == ["auto"] and got["plain"]["checkpoint_hook"] == "auto", got["plain"]
    assert "snapshots in " in got["plain"]["log"][0] and got["plain"]["log"][0].endswith("checkpoint-N/hf")
    # evaluate() before train() got the wrapper's callback and hook; the user's attach() afterwards wins both
    late = got["attach_after_first_event"]
    assert late["fullparam"] == ["own"] and late["checkpoint_hook"] == "own", late
    assert late["log"][-1].endswith("already has a FullParamExportCallback: it keeps its own; PADDLE_FULLPARAM_RECIPE "
                                    "adds none"), late


def test_trainers_the_hook_cannot_reach_are_refused_when_built(fakes, tmp_path):
    run_dir = tmp_path / "records"
    run_dir.mkdir()
    got = _probe(fakes["paddlenlp", "2.8.1"], "paddlenlp", ["no_super", "odd_handler"], tmp_path,
                 PADDLE_FULLPARAM_RECIPE="default", PADDLE_FULLPARAM_RUN_DIR=str(run_dir))
    kind, msg = got["no_super"]["error"]
    assert kind == "AutoAttachError" and "NoSuper.__init__ returned without running PaddleNLP's Trainer.__init__: " \
        "the startup hook cannot reach this Trainer class" in msg, msg
    kind, msg = got["odd_handler"]["error"]
    assert kind == "AutoAttachError" and "OddHandler has no callback_handler with a callbacks list and call_event" in msg
    rows = records.read_all(run_dir)
    assert sorted(r["state"] for r in rows) == ["refused", "refused"]
    assert any("refused: PADDLE_FULLPARAM_RECIPE asks for snapshots, but " in ln for ln in records.summary(rows))


def test_a_framework_version_it_does_not_know_is_refused_naming_it(fakes, tmp_path):
    got = _probe(fakes["paddleformers", "9.0.0"], "paddleformers", ["plain"], tmp_path, PADDLE_FULLPARAM_RECIPE="default")
    kind, msg = got["plain"]["error"]
    assert kind == "AutoAttachError", got
    assert "PADDLE_FULLPARAM_RECIPE asks for snapshots of Trainer, but PaddleFormers 9.0.0 is not a version the " \
           "startup hook knows (it knows PaddleFormers 1.2.x)" in msg, msg  # the dist-info's version, not __version__


@pytest.mark.parametrize("env,expected", [
    ({"PADDLE_FULLPARAM_RECIPE": "nope"}, "PADDLE_FULLPARAM_RECIPE='nope' PADDLE_FULLPARAM_OVERRIDES='' "
     "PADDLE_FULLPARAM_OUTPUT_DIR='' for Trainer: recipe: no recipe file 'nope'; bundled recipes: "),
    ({"PADDLE_FULLPARAM_RECIPE": "default", "PADDLE_FULLPARAM_OVERRIDES": "trigger.every_n_steps=0"},
     "for Trainer: trigger.every_n_steps: must be a whole number >= 1"),
    ({"PADDLE_FULLPARAM_RECIPE": "default", "PADDLE_FULLPARAM_OVERRIDES": "trigger.every_n_steps='2"},
     "for Trainer: PADDLE_FULLPARAM_OVERRIDES: \"trigger.every_n_steps='2\" cannot be split into key=value items"),
    ({"PADDLE_FULLPARAM_RECIPE": "default", "PADDLE_FULLPARAM_OVERRIDES": "trigger.every_n_steps"},
     "PADDLE_FULLPARAM_OVERRIDES: 'trigger.every_n_steps' is not key=value"),
    ({"PADDLE_FULLPARAM_RECIPE": "default", "PADDLE_FULLPARAM_OVERRIDES": "trigger.evry_n_steps=2"},
     "trigger.evry_n_steps: unknown key; section 'trigger' has: every_n_steps, "),
])
def test_bad_variables_set_by_hand_are_refused_when_the_trainer_is_built(fakes, tmp_path, env, expected):
    got = _probe(fakes["paddleformers", "1.2.0"], "paddleformers", ["plain"], tmp_path, **env)
    kind, msg = got["plain"]["error"]
    assert kind == "AutoAttachError" and expected in msg, msg


def test_without_the_variable_nothing_is_loaded_or_patched(fakes, tmp_path):
    got = _probe(fakes["paddleformers", "1.2.0"], "paddleformers", ["plain", "attach_after_construction"], tmp_path,
                 PADDLE_FULLPARAM_RECIPE="  ")  # blank is unset
    assert got["plain"]["fullparam"] == [] and got["attach_after_construction"]["fullparam"] == ["own"], got
    for r in got.values():
        assert "error" not in r and r["log"] == [] and not r["hook_loaded"] and not r["init_wrapped"], r


def test_a_hook_installed_after_the_framework_was_imported_patches_its_subclasses(fakes, tmp_path):
    code = (
        "import os, sys\n"
        "from paddleformers.trainer import Trainer\n"
        "class Early(Trainer):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "os.environ['PADDLE_FULLPARAM_RECIPE'] = 'default'\n"
        "from paddle_fullparam_callbacks.trainer.autoattach import startup\n"
        "assert startup.install() and startup.install()  # once, whoever calls\n"
        "t = Early(); t.train()\n"
        "print('N', sum(type(c).__name__ == 'FullParamExportCallback' for c in t.callback_handler.callbacks),\n"
        "      sum(getattr(f, '_pfc_startup_finder', False) for f in sys.meta_path))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(fakes["paddleformers", "1.2.0"]), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["N", "1", "1"], proc.stdout


@pytest.mark.parametrize("version,code,expected", [
    ("1.2.0", 0, "  paddleformers.trainer.trainer.Trainer (paddleformers 1.2.0, rank 0): FullParamExportCallback attached; "
                 "snapshots in {cwd}/fake_out/fullparam (0 committed)"),
    ("9.0.0", 1, "  paddleformers.trainer.trainer.Trainer (paddleformers 9.0.0, rank 0): refused: PADDLE_FULLPARAM_RECIPE "
                 "asks for snapshots of Trainer, but PaddleFormers 9.0.0 is not a version the startup hook knows"),
])
def test_run_reports_what_each_trainer_got(fakes, tmp_path, version, code, expected):
    """Through ``run`` (the hook's folder put on PYTHONPATH by run itself): the Trainer's process tells run,
    which prints it after COMMAND's own output and exits with COMMAND's status."""
    env = _env(fakes["paddleformers", version])
    env["PYTHONPATH"] = os.pathsep.join([str(fakes["paddleformers", version]), str(ROOT)])  # no hook folder: run adds it
    proc = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "run", "--", sys.executable, "-c",
                           "from paddleformers.trainer import Trainer; Trainer().train()"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert f"paddle-fullparam run: COMMAND ended (exit status {code}); 1 Trainer(s) built:" in lines, proc.stderr
    assert any(ln.startswith(expected.format(cwd=tmp_path)) for ln in lines), proc.stderr
    if code:
        assert "AutoAttachError: PADDLE_FULLPARAM_RECIPE asks for snapshots of Trainer" in proc.stderr  # the traceback
