"""The start's check of ``evaluate.lm_eval``, in the training job (the coordinator, before step 1; and
``paddle-fullparam evaluate``): the task folder exists, then ``probe.py`` runs in the evaluation environment (the
harness and the backend's extras import there, every named task is found, every local data file it reads exists).
The first problem is raised as one ConfigError naming its key.
"""
from __future__ import annotations

import json
import os
import subprocess
from typing import List

from ....config.errors import ConfigError
from .spec import MODULE, OFFLINE, build_spec, task_folder

PROBE_TIMEOUT_S = 600.0  # the built-in tasks' index alone takes ~20 s on a quiet machine


def check_lm_eval(cfg, python: List[str], timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """Prove ``evaluate.lm_eval`` (``cfg``) usable with the interpreter ``python``; returns the probe's answer
    (``lm_eval``: its version, ``tasks``: each task's file). Raises ConfigError."""
    folder = task_folder(cfg)
    if not folder.is_dir():
        raise ConfigError("evaluate.lm_eval.include_path", f"{folder} is not a folder (of task YAML files and their data)")
    spec = json.dumps(build_spec(cfg))
    try:
        proc = subprocess.run([*python, "-m", MODULE, "probe", "--spec", spec], capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **OFFLINE}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError("evaluate.python", f"the probe of lm-eval in {python[0]} did not finish in {timeout_s:g} s") from None
    except OSError as e:
        raise ConfigError("evaluate.python", f"cannot start {python[0]}: {e}") from e
    answer = _last_json(proc.stdout)
    if proc.returncode != 0 or answer is None:
        tail = (proc.stderr or proc.stdout).strip()[-600:]
        if "No module named 'paddle_fullparam_callbacks'" in tail:
            raise ConfigError("evaluate.python", f"{python[0]} cannot import paddle_fullparam_callbacks, which runs the "
                                                 "bundled lm-eval evaluator there: install it in that environment "
                                                 "(pip install 'paddle-fullparam-callbacks[lm-eval]') or put it on "
                                                 "its PYTHONPATH")
        raise ConfigError("evaluate.python", f"the probe of lm-eval in {python[0]} failed (exit {proc.returncode}): {tail}")
    problems = answer.get("problems") or []
    if problems:
        key, message = problems[0]
        raise ConfigError(str(key), str(message))
    return answer


def _last_json(text: str):
    for line in reversed((text or "").strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None
