"""``paddle-fullparam run [--recipe NAME|PATH] [--output-dir DIR] [KEY=VALUE ...] -- COMMAND [ARG ...]``.

Runs COMMAND unchanged (its arguments, its standard streams, its exit status), with the
``PADDLE_FULLPARAM_*`` variables set, so that every PaddleFormers or PaddleNLP Trainer built anywhere
in its process tree gets exactly one FullParamExportCallback (``trainer/autoattach``). Before COMMAND
starts, the recipe, the overrides and the output directory are checked (exit 2, naming the value) and
COMMAND is looked up (exit 127). While it runs, the signals sent to ``run`` itself are passed on to it.
When it has ended, ``run`` says which Trainers were built and what each got, or that none was.
"""
from __future__ import annotations

import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from ..config.schema import ConfigError
from ..trainer.autoattach import records
from ..trainer.autoattach.settings import DEFAULT_RECIPE, RunSettings, check_output_dir
from ..trainer.autoattach.startup import RUN_DIR

PACKAGE_DIR = Path(__file__).resolve().parents[1]
SITEDIR = PACKAGE_DIR / "trainer" / "autoattach" / "sitedir"
PTH_NAME = "paddle_fullparam_callbacks.pth"
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, name))
USAGE = "paddle-fullparam run [--recipe NAME|PATH] [--output-dir DIR] [KEY=VALUE ...] -- COMMAND [ARG ...]"


def add_parser(sub, overrides_help: str) -> None:
    text = ("run COMMAND (e.g. paddleformers-cli train sft.yaml, or python -m paddle.distributed.launch ...) so that "
            "every PaddleFormers or PaddleNLP Trainer it builds, in any process, exports full-parameter snapshots")
    r = sub.add_parser("run", help=text, usage=USAGE, description=text + "; exits with COMMAND's status (2 for a bad "
                       "recipe, override or output directory, 127 if COMMAND is not found).")
    r.add_argument("--recipe", help=f"a bundled recipe name or a YAML path (default: $PADDLE_FULLPARAM_RECIPE, else "
                                    f"{DEFAULT_RECIPE!r}: the package's defaults, a snapshot at each trainer save and "
                                    "at the end)")
    r.add_argument("--output-dir", help="where the snapshots go (default: $PADDLE_FULLPARAM_OUTPUT_DIR, else the "
                                        "recipe's output_dir, else <TrainingArguments.output_dir>/fullparam)")
    r.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help=overrides_help + "; added after $PADDLE_FULLPARAM_OVERRIDES")
    r.set_defaults(func=cmd_run, command_argv=None)


def split_command(args: List[str]):
    """``run ... -- COMMAND ...`` -> (the arguments for the parser, COMMAND or None)."""
    if args[:1] == ["run"] and "--" in args:
        i = args.index("--")
        return args[:i], args[i + 1:]
    return args, None


def _say(msg: str) -> None:
    print(f"paddle-fullparam run: {msg}", file=sys.stderr, flush=True)


def cmd_run(ns) -> int:
    command = ns.command_argv
    if not command:
        loose = [o for o in ns.overrides if "=" not in o]
        hint = f" (is {' '.join(loose)!r} the command? put -- before it)" if loose else ""
        _say(f"no COMMAND to run{hint}; usage: {USAGE}")
        return 2
    try:
        settings = RunSettings.from_environ().with_flags(ns.recipe, ns.output_dir, ns.overrides).absolute()
        config = settings.load_config()
        if config.output_dir:
            check_output_dir(config.output_dir)
    except ConfigError as e:
        _say(f"{e}; nothing was started")
        return 2
    if _which(command[0], os.environ.get("PATH")) is None:
        _say(f"{command[0]}: command not found; nothing was started")
        return 127
    run_dir = tempfile.mkdtemp(prefix="paddle-fullparam-run-")
    try:
        status = _spawn_and_wait(command, child_environ(os.environ, settings, run_dir))
        _report(run_dir, status)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if status < 0:  # COMMAND was killed by a signal: end the same way, for whoever waits for run
        _die_of(-status)
        return 128 - status
    return status


def _which(program: str, path: Optional[str]) -> Optional[str]:
    if os.sep in program:
        return program if os.access(program, os.X_OK) and not os.path.isdir(program) else None
    return shutil.which(program, path=path)


def wheel_hook_installed(package_dir: Path = PACKAGE_DIR) -> bool:
    """Whether this package was imported from a site directory that holds the wheel's ``.pth`` hook
    (then every Python of that environment runs the hook, and PYTHONPATH stays as it is)."""
    root = package_dir.parent
    sites = [Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()] if p]
    return (root / PTH_NAME).is_file() and root.resolve() in sites


def child_environ(environ, settings: RunSettings, run_dir: str) -> dict:
    """COMMAND's environment: the caller's, with the ``PADDLE_FULLPARAM_*`` variables; from a clone (no
    wheel hook) also the hook's folder first on PYTHONPATH and the checkout after the caller's entries."""
    env = dict(environ)
    env.update(settings.to_environ())
    env[RUN_DIR] = run_dir
    if not wheel_hook_installed():
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != SITEDIR]
        if str(PACKAGE_DIR.parent) not in [str(Path(p).resolve()) for p in parts]:
            parts.append(str(PACKAGE_DIR.parent))
        env["PYTHONPATH"] = os.pathsep.join([str(SITEDIR), *parts])
    return env


def _spawn_and_wait(command: List[str], env: dict) -> int:
    """COMMAND's return code (negative: killed by that signal). The signals of ``FORWARDED`` are taken
    synchronously: one sent to ``run`` by a process (kill, a scheduler) is passed on to COMMAND; one the
    terminal sent to the whole foreground group (Ctrl-C) has reached COMMAND already and is not sent twice."""
    if not hasattr(signal, "sigtimedwait"):  # not POSIX: no forwarding, COMMAND's status all the same
        return subprocess.call(command, env=env)
    watch = set(FORWARDED) | {signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watch)
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, old_mask))
        while True:
            code = proc.poll()
            if code is not None:
                return code
            info = signal.sigtimedwait(watch, 0.5)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_code <= 0:  # SI_USER, SI_QUEUE, SI_TKILL: sent by a process, to run alone
                try:
                    os.kill(proc.pid, info.si_signo)
                except ProcessLookupError:
                    pass
    finally:
        while signal.sigtimedwait(watch, 0) is not None:  # a terminal's Ctrl-C, already seen by COMMAND
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _report(run_dir: str, status: int) -> None:
    how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    found = records.read_all(run_dir)
    if not found:
        _say(f"COMMAND ended ({how}) without ever building a PaddleFormers or PaddleNLP Trainer: no "
             "FullParamExportCallback was attached and no snapshot was taken (a Trainer built by a Python started "
             "with -I, -E or -S, or with a cleared environment, does not run the startup hook)")
        return
    _say(f"COMMAND ended ({how}); {len(found)} Trainer(s) built:")
    for line in records.summary(found):
        print(f"  {line}", file=sys.stderr, flush=True)


def _die_of(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
