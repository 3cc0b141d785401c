"""The command line as a user reads it: --version, plain-text help describing every argument,
numbers checked where they are read, a pipe closed early."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paddle_fullparam_callbacks import __version__
from paddle_fullparam_callbacks.cli.main import build_parser, main

COMMANDS = ["demo", "verify", "plan", "recipes", "run"]


def _run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_version():
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"paddle-fullparam {__version__}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text_and_describes_every_argument(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"] if command else ["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text and ":func:" not in text  # no rst markup
    parser = build_parser()
    if command:
        parser = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices[command]
        assert parser.description  # says what the command does
    for action in parser._actions:
        assert action.help, (command, action.dest)  # every argument described


@pytest.mark.parametrize("args, message", [
    (["plan", "--files", "-1"], "argument --files: must be a whole number >= 1; got -1"),
    (["plan", "--mp", "0"], "argument --mp: must be a whole number >= 1; got 0"),
    (["plan", "--sharding-stage", "4"], "argument --sharding-stage: invalid choice: 4"),
    (["demo", "--steps", "0"], "argument --steps: must be a whole number >= 1; got 0"),
    (["demo", "--steps", "-3"], "argument --steps: must be a whole number >= 1; got -3"),
    (["demo", "--steps", "ten"], "argument --steps: 'ten' is not a whole number"),
])
def test_numbers_are_checked_where_they_are_read(args, message):
    r = _run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_verify_json_usage_error_still_prints_json():
    r = _run("verify", "--json", "--bogus")
    assert r.returncode == 2 and json.loads(r.stdout)["ok"] is False


def test_a_pipe_closed_early_ends_quietly():
    p = subprocess.Popen([sys.executable, "-m", "paddle_fullparam_callbacks", "plan", "--dp", "64", "--mp", "8",
                          "--pp", "8", "--files", "20000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
