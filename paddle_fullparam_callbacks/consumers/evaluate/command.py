"""What runs for one evaluation: the interpreter (``evaluate.python``) and the evaluator's argv.

Pure except for :func:`resolve_python`, which reads the environment and looks the interpreter up
(once, when the job starts, so a wrong one stops the job before training).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import List, Mapping, Optional

from ...config.schema import ConfigError, EvaluateConfig
from .lmeval import spec as lmeval

CALL_BOOTSTRAP = """\
import importlib, json, sys
spec, snapshot, step, output = sys.argv[1:5]
module, _, name = spec.partition(":")
fn = importlib.import_module(module)
for part in name.split("."):
    fn = getattr(fn, part)
result = fn(snapshot=snapshot, step=int(step), output=output)
if result is not None:
    text = json.dumps(result)
    with open(output, "w") as f:
        f.write(text)
    print(text)
"""
"""``python -c`` code that runs ``evaluate.callable`` in the evaluator's interpreter: it needs
nothing of this package there, only the callable's own module."""


def resolve_python(cfg: EvaluateConfig, environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The words that start the evaluator's interpreter: ``evaluate.python`` (``$NAME`` read from the
    environment, a command split like a shell would), or this job's interpreter. Raises
    :class:`ConfigError` naming ``evaluate.python`` when it cannot be found.

    >>> resolve_python(EvaluateConfig(command="x", python="$NOPE_X"), {})
    Traceback (most recent call last):
    ...
    paddle_fullparam_callbacks.config.schema.ConfigError: evaluate.python: $NOPE_X is not set in this job's environment; set it to the interpreter of the evaluator's environment, or give evaluate.python as a path
    """
    environ = os.environ if environ is None else environ
    given = cfg.python
    if given is None:
        return [sys.executable]
    text = given
    if given.startswith("$"):
        text = environ.get(given[1:], "")
        if not text.strip():
            raise ConfigError("evaluate.python", f"{given} is not set in this job's environment; set it to the "
                                                 "interpreter of the evaluator's environment, or give "
                                                 "evaluate.python as a path")
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError("evaluate.python", f"{text!r} does not split into words ({e})") from e
    found = _executable(words[0]) if words else None
    if found is None:
        via = f" (from {given})" if given != text else ""
        raise ConfigError("evaluate.python", f"{words[0] if words else text!r}{via} is not an executable file or a "
                                             "command on PATH")
    return [found, *words[1:]]


def _executable(word: str) -> Optional[str]:
    if os.sep in word:
        path = os.path.abspath(os.path.expanduser(word))
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    return shutil.which(word)


def build_argv(cfg: EvaluateConfig, python: List[str], snapshot: Path, step: int, output: Path, name: str = "",
               api_key_env: Optional[str] = None, adapter: Optional[dict] = None) -> List[str]:
    """The evaluator's argv for one snapshot (``name``: the snapshot's, the weight version an engine serving it
    reports; ``api_key_env``: ``serve.api_key_env``, and ``adapter``: ``{"name", "root"}`` of a LoRA run served as
    adapters, for ``evaluate.lm_eval``'s engine backend).

    >>> build_argv(EvaluateConfig(command="{python} -m ev {snapshot} --step {step} -o {output}"),
    ...            ["/py", "-X", "utf8"], Path("/s/hf step"), 10, Path("/s/o.json"))
    ['/py', '-X', 'utf8', '-m', 'ev', '/s/hf step', '--step', '10', '-o', '/s/o.json']
    """
    values = {"snapshot": str(snapshot), "step": str(int(step)), "output": str(output)}
    if cfg.lm_eval.enabled:
        return lmeval.build_argv(cfg.lm_eval, python, snapshot, output, name or snapshot.name, api_key_env, adapter)
    if cfg.callable:
        return [*python, "-c", CALL_BOOTSTRAP, cfg.callable, values["snapshot"], values["step"], values["output"]]
    out: List[str] = []
    for word in shlex.split(cfg.command or ""):
        if word == "{python}":  # the interpreter may be several words (`conda run -n hf python`)
            out.extend(python)
        else:
            out.append(word.format(python=shlex.join(python), **values))
    return out


def describe(argv: List[str]) -> str:
    """The argv as one line for the record and the log (the callable's bootstrap code elided)."""
    shown = ["<bootstrap>" if a == CALL_BOOTSTRAP else a for a in argv]
    return shlex.join(shown)


def describe_evaluator(cfg: EvaluateConfig) -> str:
    """What evaluates, in a few words (for the lines ``paddle-fullparam evaluate`` prints).

    >>> describe_evaluator(EvaluateConfig(command="{python} -m ev {snapshot}"))
    '{python} -m ev {snapshot}'
    """
    if cfg.lm_eval.enabled:
        return f"lm-eval ({', '.join(cfg.lm_eval.tasks)}; backend {cfg.lm_eval.backend})"
    return str(cfg.command or cfg.callable)
