"""The start's proof that every engine of ``serve.url`` can take the job's snapshots: it answers, it has the
endpoints a swap needs, and, where its model directory can be read from here, the snapshots fit its model
(``fit.py``). Run on the coordinator before step 1 (and by ``paddle-fullparam serve``); what fails is one
error naming ``serve.url``, the engine and what is missing. What it learns of each engine (the directory it
loaded, the weights it serves now) becomes the first fallback of its swaps (:func:`initial_states`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

from ...config.schema import ConfigError, ServeConfig
from ...config.serving import format_engine_path
from ...export.commit.ownership import read_manifest
from .engines import EngineError, Probe, Target, engine_class
from .engines.base import MISSING, REFUSED, TIMEOUT, UNREACHABLE
from .fit import fit_problems, read_model_dir
from .hook import EngineState

logger = logging.getLogger("paddle_fullparam_callbacks")
Model = Tuple[Optional[str], Dict[str, tuple]]
START_VERSION = "default"  # vLLM's name for the weights it loaded at its start


class ServeStartFailed(RuntimeError):
    """An engine cannot take the job's snapshots (raised on every rank, before the first step)."""


def api_key(cfg: ServeConfig, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The engines' API key from ``serve.api_key_env``'s variable; ConfigError when it names an unset one."""
    if not cfg.api_key_env:
        return None
    key = environ.get(cfg.api_key_env, "")
    if not key.strip():
        raise ConfigError("serve.api_key_env", f"names ${cfg.api_key_env}, which is not set (or empty) in this "
                                               "environment: export it before the job starts")
    return key


def _explain(e: EngineError, cfg: ServeConfig) -> str:
    if e.kind == UNREACHABLE:
        return f"nothing answers ({e}); is the engine started, and reachable from this node?"
    if e.kind == TIMEOUT:
        return f"no answer within serve.timeout_s={cfg.timeout_s:g} s ({e})"
    if e.kind == REFUSED and e.status in (401, 403):
        return (f"refused ({e}); give the engine's API key in the variable that serve.api_key_env names"
                if not cfg.api_key_env else f"refused the key in ${cfg.api_key_env} ({e})")
    if e.kind == MISSING:
        return f"has no {e.call} ({e}); is it a {cfg.engine} server?"
    return str(e)


def prove_engines(cfg: ServeConfig, ours: Optional[Model], environ: Mapping[str, str] = os.environ,
                  say: Callable[[str], None] = logger.info) -> Dict[str, Probe]:
    """Probe every engine; {url: Probe} when all can take snapshots of the model ``ours`` (architecture,
    {tensor: shape}; None: not checked), else ServeStartFailed naming serve.url, each engine at fault and why."""
    key = api_key(cfg, environ)
    cls = engine_class(cfg.engine)
    problems, found = [], {}
    for url in cfg.urls:
        try:
            p = cls(url, key, cfg.timeout_s, cfg.reload_timeout_s).probe()
        except EngineError as e:
            problems.append(f"{url} {_explain(e, cfg)}")
            continue
        found[url] = p
        if p.missing:
            problems.append(f"{url} lacks {', '.join(p.missing)}: {p.note}")
            continue
        if not (cfg.check_model and ours is not None):
            continue
        root = p.model_root
        if not root or not Path(root).is_dir():
            say(f"serve: the model directory of {url} ({root}) cannot be read from here: whether the snapshots fit "
                "its model is not checked at start (serve.check_model)")
            continue
        try:
            theirs = read_model_dir(root)
        except (OSError, ValueError) as e:
            say(f"serve: the model directory of {url} ({root}) cannot be read as a model ({e}): whether the "
                "snapshots fit it is not checked at start")
            continue
        misfit = fit_problems(ours, theirs)
        if misfit:
            problems.append(f"{url} serves the model in {root}, which the job's snapshots do not fit: " + "; ".join(misfit))
    if problems:
        raise ServeStartFailed("serve.url: " + " | ".join(problems))
    return found


def initial_states(cfg: ServeConfig, probes: Dict[str, Probe], output_dir: Optional[Path]) -> Dict[str, EngineState]:
    """Each engine's first fallback: the snapshot of ``output_dir`` its weights are named after, if there is
    one; else the directory it loaded at its start, under vLLM's name for those weights (``default``)."""
    states = {}
    for url in cfg.urls:
        p = probes.get(url)
        state = EngineState(url)
        if p is not None and p.version and output_dir is not None:
            snap = Path(output_dir) / p.version
            manifest = read_manifest(snap) if "/" not in p.version and not p.version.startswith(".") else None
            if manifest is not None:
                step = manifest.get("step")
                state.served = Target(format_engine_path(cfg.path_template, str(snap.resolve()), p.version,
                                                         step if isinstance(step, int) else 0), p.version)
                state.snapshot = p.version
        if state.served is None and p is not None and p.model_root:
            state.served = Target(p.model_root, START_VERSION)
        states[url] = state
    return states
