"""``paddle-fullparam run`` as a wrapper (no Paddle in these processes): bad input refused in seconds
before COMMAND starts, with the value named; COMMAND's arguments, output and exit status unchanged (a
death by signal included); signals sent to ``run`` passed on; a process that never imports a framework
behaves as without the wrapper, and the sitecustomize the hook shadows still runs; ``run`` says so when
no Trainer was built. The settings' round trip through the environment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paddle_fullparam_callbacks.cli.run import SITEDIR, child_environ, wheel_hook_installed
from paddle_fullparam_callbacks.config.schema import ConfigError
from paddle_fullparam_callbacks.trainer.autoattach.settings import RunSettings, check_output_dir, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
NO_TRAINER = "without ever building a PaddleFormers or PaddleNLP Trainer"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _run(*args, cwd=None, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "run", *map(str, args)], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,env,code,message", [
    (["--recipe", "nope"], {}, 2, "recipe: no recipe file 'nope'; bundled recipes: async_every_n_steps, "),
    (["trigger.every_n_steps=0"], {}, 2, "trigger.every_n_steps: must be a whole number >= 1"),
    (["trigger.evry_n_steps=2"], {}, 2, "trigger.evry_n_steps: unknown key; section 'trigger' has: every_n_steps"),
    (["--recipe", "hf_every_n_steps", "export.dtype=int3"], {}, 2, "export.dtype: must be one of "),
    ([], {"PADDLE_FULLPARAM_RECIPE": "nope.yaml"}, 2, "recipe: no recipe file 'nope.yaml'"),
    ([], {"PADDLE_FULLPARAM_OVERRIDES": "retention.keep_last=-1"}, 2, "retention.keep_last"),
    ([], {"PADDLE_FULLPARAM_OVERRIDES": "a='b"}, 2, "PADDLE_FULLPARAM_OVERRIDES: \"a='b\" cannot be split"),
    ([], {"PADDLE_FULLPARAM_OVERRIDES": "every_n_steps"}, 2, "PADDLE_FULLPARAM_OVERRIDES: 'every_n_steps' is not key=value"),
    (["--output-dir", "{file}/snaps"], {}, 2, "output_dir: '{file}/snaps' cannot be created: '{file}' is not a directory"),
    (["--output-dir", "{file}"], {}, 2, "output_dir: '{file}' exists and is not a directory"),
    ([], {"PADDLE_FULLPARAM_OUTPUT_DIR": "/proc/pfc-snaps"}, 2, "output_dir: '/proc/pfc-snaps' cannot be created: "
                                                                "'/proc' is not writable"),
])
def test_bad_input_is_refused_before_command_starts(tmp_path, args, env, code, message):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    marker = tmp_path / "started"
    args = [a.replace("{file}", str(afile)) for a in args]
    t0 = time.perf_counter()
    proc = _run(*args, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')", cwd=tmp_path, env=_env(**env))
    seconds = time.perf_counter() - t0
    assert proc.returncode == code, proc.stderr
    assert message.replace("{file}", str(afile)) in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("nothing was started") and proc.stderr.count("\n") == 1, proc.stderr
    assert not marker.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written
    assert seconds < 60  # a hang guard only (a refusal takes ~1 s idle, 4-6 s on a loaded 2-core machine)


@pytest.mark.parametrize("args,code,message", [
    (["--", "no-such-command-pfc"], 127, "no-such-command-pfc: command not found; nothing was started"),
    (["--", "./missing.sh"], 127, "./missing.sh: command not found"),
    (["--"], 2, "no COMMAND to run; usage: paddle-fullparam run "),
    (["trigger.every_n_steps=2", "paddleformers-cli", "train", "x.yaml"], 2,
     "no COMMAND to run (is 'paddleformers-cli train x.yaml' the command? put -- before it)"),
])
def test_a_command_that_cannot_run_is_named(tmp_path, args, code, message):
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == code and message in proc.stderr, proc.stderr


def test_command_runs_unchanged_and_its_status_is_run_s(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'stdin': sys.stdin.read(),\n"
        "                  'env': {k: v for k, v in os.environ.items() if k.startswith('PADDLE_FULLPARAM_')},\n"
        "                  'heavy': sorted(m for m in ('paddle', 'numpy', 'omegaconf', 'paddle_fullparam_callbacks')\n"
        "                                  if m in sys.modules)}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(7)\n")
    (tmp_path / "my.yaml").write_text("trigger:\n  every_n_steps: 5\n")
    args = ["a b", "--flag", "--", "x=1"]
    proc = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "run", "--recipe", "my.yaml",
                           "--output-dir", "snaps", "retention.keep_last=2", "evaluate.command=echo {snapshot}",
                           "--", sys.executable, str(script), *args], cwd=tmp_path, env=_env(), input="from stdin",
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen["argv"] == args and seen["cwd"] == str(tmp_path) and seen["stdin"] == "from stdin"
    assert seen["heavy"] == []  # the hook imports nothing heavy in a process that never imports a framework
    assert seen["env"]["PADDLE_FULLPARAM_RECIPE"] == str(tmp_path / "my.yaml")  # made absolute for every rank
    assert seen["env"]["PADDLE_FULLPARAM_OUTPUT_DIR"] == str(tmp_path / "snaps")
    assert parse_overrides(seen["env"]["PADDLE_FULLPARAM_OVERRIDES"]) == ("retention.keep_last=2",
                                                                          "evaluate.command=echo {snapshot}")
    assert proc.stderr.startswith("to stderr\n") and NO_TRAINER in proc.stderr
    assert "(exit status 7)" in proc.stderr
    assert not (tmp_path / "snaps").exists()  # checked, not made


def test_a_command_killed_by_a_signal_kills_run_the_same_way(tmp_path):
    proc = _run("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR2)", cwd=tmp_path)
    assert proc.returncode == -signal.SIGUSR2, proc.stderr
    assert f"(killed by signal {int(signal.SIGUSR2)})" in proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_signals_sent_to_run_reach_command(tmp_path, sig):
    child = ("import signal, sys\n"
             "def got(n, f):\n"
             "    print('GOT', n, flush=True); sys.exit(40 + n % 20)\n"
             f"signal.signal({int(sig)}, got)\n"
             "print('READY', flush=True)\n"
             "signal.pause()\n")
    proc = subprocess.Popen([sys.executable, "-m", "paddle_fullparam_callbacks", "run", "--", sys.executable, "-c",
                             child], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(sig)  # to run alone (COMMAND is in its process group but not signalled by the test)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert out.split() == ["GOT", str(int(sig))], (out, err)
    assert proc.returncode == 40 + int(sig) % 20, err


def test_sitecustomize_it_shadows_still_runs(tmp_path):
    user = tmp_path / "user-site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\nMARK = 'user'\n")
    code = ("import os, sys; print(os.environ.get('USER_SITECUSTOMIZE'), getattr(sys.modules.get('sitecustomize'), "
            "'MARK', None), '_paddle_fullparam_startup' in sys.modules)")
    env = _env(PYTHONPATH=os.pathsep.join([str(ROOT), str(user)]))
    direct = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    wrapped = _run("--", sys.executable, "-c", code, env=env, cwd=tmp_path)
    assert direct.stdout.split() == ["ran", "user", "False"], direct.stderr
    assert wrapped.stdout.split() == ["ran", "user", "True"], wrapped.stderr  # both hooks ran
    # a broken one fails as Python reports it without the wrapper, and the hook is in place all the same
    (user / "sitecustomize.py").write_text("raise RuntimeError('user site broken')\n")
    direct = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    wrapped = _run("--", sys.executable, "-c", code, env=env, cwd=tmp_path)
    assert "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: user site broken" in direct.stderr
    assert "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: user site broken" in wrapped.stderr
    assert wrapped.stdout.split()[-1] == "True"


def test_the_hook_folder_is_put_first_only_for_a_clone(tmp_path):
    settings = RunSettings("hf_every_n_steps", str(tmp_path / "o"), ("a=1", "b=two words"))
    env = child_environ({"PYTHONPATH": f"/x{os.pathsep}{SITEDIR}", "PATH": "/bin"}, settings, str(tmp_path))
    assert not wheel_hook_installed()  # this test imports the checkout
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITEDIR), "/x", str(ROOT)]
    assert env["PADDLE_FULLPARAM_RUN_DIR"] == str(tmp_path) and env["PATH"] == "/bin"
    assert RunSettings.from_environ(env) == settings  # the round trip every rank makes
    assert (SITEDIR.parent.parent.parent.parent / "paddle_fullparam_callbacks").is_dir()
    assert sorted(p.name for p in SITEDIR.glob("*.py")) == ["__init__.py", "sitecustomize.py"]  # no other module


def test_settings_rules():
    assert RunSettings.from_environ({}).recipe == "default"
    assert RunSettings.from_environ({}).load_config().trigger.exports_on_save  # the package's defaults
    s = RunSettings.from_environ({"PADDLE_FULLPARAM_OVERRIDES": "a=1"}).with_flags("r", None, ["b=2"])
    assert (s.recipe, s.output_dir, s.overrides) == ("r", None, ("a=1", "b=2"))
    with pytest.raises(ConfigError, match="dangling symbolic link"):
        link = Path(os.environ.get("TMPDIR", "/tmp")) / f"pfc-dangling-{os.getpid()}"
        link.symlink_to(link.with_name(link.name + "-nowhere"))
        try:
            check_output_dir(link / "x")
        finally:
            link.unlink()
