"""The start's proof that every engine of ``serve.url`` can take the job's snapshots: it answers, it has the
endpoints a swap needs, and, where its model directory can be read from here, the snapshots fit its model
(``fit.py``); for a LoRA run served as adapters, that it takes the run's adapter on the run's base
(``adapter_start.py``). Run on the coordinator before step 1 (and by ``paddle-fullparam serve``); what fails is one
error naming ``serve.url``, the engine and what is missing. What it learns of each engine (the directory it
loaded, the weights it serves now) becomes the first fallback of its swaps (:func:`initial_states`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

from ...config.schema import ConfigError, ServeConfig
from ...config.serving import format_adapter_path, format_engine_path
from ...export.commit.ownership import read_manifest
from . import adapters
from .adapter_start import RunAdapter, adapter_problems
from .engines import EngineError, Probe, Target, engine_class
from .engines.base import MISSING, REFUSED, TIMEOUT, UNREACHABLE
from .fit import fit_problems, read_model_dir
from .hook import EngineState

logger = logging.getLogger("paddle_fullparam_callbacks")
Model = Tuple[Optional[str], Dict[str, tuple]]
START_VERSION = "default"  # vLLM's name for the weights it loaded at its start


class ServeStartFailed(ConfigError):
    """An engine cannot take the job's snapshots (raised on every rank, before the first step); ``key`` is the
    recipe key to look at: ``serve.url`` (the engine itself), ``serve.adapter``, ``serve.path_template``..."""


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
                  say: Callable[[str], None] = logger.info, adapter: Optional[RunAdapter] = None,
                  output_dir: Optional[Path] = None, run_id: str = "start") -> Dict[str, Probe]:
    """Probe every engine; {url: Probe} when all can take snapshots of the model ``ours`` (architecture,
    {tensor: shape}; None: not checked), else ServeStartFailed naming serve.url, each engine at fault and why.
    ``adapter`` (``serve.adapter``): the run's adapter, which every engine must take on the run's base
    (``adapter_start.py``, through ``output_dir``); its problems name their own keys."""
    key = api_key(cfg, environ)
    cls = engine_class(cfg.engine)
    problems, found, engines = [], {}, {}
    for url in cfg.urls:
        engines[url] = engine = cls(url, key, cfg.timeout_s, cfg.reload_timeout_s)
        try:
            p = engine.probe(adapter=cfg.adapter)
        except EngineError as e:
            problems.append(("serve.url", f"{url} {_explain(e, cfg)}"))
            continue
        found[url] = p
        if p.missing:
            problems.append(("serve.adapter" if cfg.adapter else "serve.url",
                             f"{url} lacks {', '.join(p.missing)}: {p.note}"))
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
            what = "the run's base (its snapshots' names and shapes) does not fit" if cfg.adapter else \
                "the job's snapshots do not fit"
            problems.append(("serve.url", f"{url} serves the model in {root}, which {what}: " + "; ".join(misfit)))
    if not problems and adapter is not None:
        problems = adapter_problems(cfg, {u: engines[u] for u in found}, found, adapter, Path(output_dir), run_id)
    if problems:
        raise ServeStartFailed(problems[0][0], " | ".join(message for _, message in problems))
    return found


def initial_states(cfg: ServeConfig, probes: Dict[str, Probe], output_dir: Optional[Path]) -> Dict[str, EngineState]:
    """Each engine's first fallback: the snapshot of ``output_dir`` its weights are named after, if there is
    one; else the directory it loaded at its start, under vLLM's name for those weights (``default``). Adapter
    mode: the adapters it holds that are the snapshots' of ``output_dir`` (:func:`~.adapters.initial`)."""
    states = {}
    for url in cfg.urls:
        p = probes.get(url)
        state = EngineState(url)
        if cfg.adapter and p is not None:
            state.held = adapters.initial(p.adapters, cfg.adapter_name, _adapter_dirs(cfg, p, output_dir))
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


def _adapter_dirs(cfg: ServeConfig, p: Probe, output_dir: Optional[Path]) -> Dict[str, tuple]:
    """{snapshot name: (step, its adapter's directory as the engine sees it)} of the snapshots of ``output_dir``
    whose names the engine's adapters carry, or whose directories they were loaded from."""
    out: Dict[str, tuple] = {}
    if output_dir is None:
        return out
    names = set(p.adapters) | {Path(root).parent.name for root in p.adapters.values()}
    for name in names:
        if not name or "/" in name or name.startswith("."):
            continue
        snap = Path(output_dir) / name
        manifest = read_manifest(snap)
        if manifest is None:
            continue
        step = manifest.get("step") if isinstance(manifest.get("step"), int) else 0
        out[name] = (step, format_adapter_path(cfg.path_template, str(snap.resolve()), name, step))
    return out
