"""The rules of the ``serve:`` section (``schema.ServeConfig``): :func:`check_serve` finds None or the problem
as ``(recipe key, message)``, raised as the schema's ``ConfigError`` when one is passed in (this module is
below the schema). Pure: nothing here talks to an engine; the engines are proven at the start of training
(``consumers/serve/probe.py``, and ``consumers/serve/adapters/start.py`` for ``serve.adapter``).
"""
from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

from .rules import check_template, flags_problem, number_problem

Problem = Optional[Tuple[str, str]]
ENGINES = ("vllm",)
"""The engines' protocols this package speaks (``consumers/serve/engines/``, one module each)."""
PATH_FIELDS = ("snapshot", "name", "step")
"""The fields of ``serve.path_template``: the snapshot's absolute path here, its name, its step."""
_URL = re.compile(r"https?://[^/\s?#]+(/[^\s?#]*)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def engine_urls(value: Any) -> List[str]:
    """The engines' base URLs of ``serve.url``: one URL, several separated by commas or spaces (as an
    environment variable carries them), or a list; each without its trailing slash. ValueError naming
    what is wrong.

    >>> engine_urls("http://10.0.0.5:8000/, http://10.0.0.6:8000")
    ['http://10.0.0.5:8000', 'http://10.0.0.6:8000']
    >>> engine_urls(["http://a:8000", "ftp://b"])
    Traceback (most recent call last):
    ...
    ValueError: 'ftp://b' is not an engine's base URL: give http(s)://host:port (a path after it is kept)
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = [u for u in re.split(r"[,\s]+", value) if u]
    elif isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        items = list(value)
    else:
        raise ValueError(f"must be a URL or a list of URLs; got {value!r}")
    out: List[str] = []
    for item in items:
        if not isinstance(item, str) or not _URL.fullmatch(item.strip()):
            raise ValueError(f"{item!r} is not an engine's base URL: give http(s)://host:port (a path after it is kept)")
        url = item.strip().rstrip("/")
        if url in out:
            raise ValueError(f"{url} is named twice; name each engine (replica) once")
        out.append(url)
    if not out:
        raise ValueError(f"names no engine; got {value!r} (leave it null to serve nothing)")
    return out


def check_serve(s, error=None) -> Problem:
    """The serve section on its own (``s.url`` is normalised to a list of URLs); with ``error`` (an exception
    class taking (key, message)), a problem is raised as it."""
    problem = _serve_problem(s)
    if problem and error is not None:
        raise error(*problem)
    return problem


def _serve_problem(s) -> Problem:
    try:
        urls = engine_urls(s.url)
    except ValueError as e:
        return "serve.url", str(e)
    s.url = urls or None
    if isinstance(s.engine, bool) or s.engine not in ENGINES:
        return "serve.engine", f"must be one of {', '.join(ENGINES)}; got {s.engine!r}"
    problem = check_template("serve.path_template", s.path_template, PATH_FIELDS, "'/models/{name}'", "template")
    if problem:
        return problem
    if len(str(s.path_template).split()) != 1:
        return "serve.path_template", f"is one path, without spaces; got {s.path_template!r}"
    if not (s.path_template.startswith("/") or s.path_template.startswith("{snapshot}")):
        return "serve.path_template", ("must give an absolute path as the engines see it: start with / or "
                                       f"{{snapshot}} (e.g. /models/{{name}}); got {s.path_template!r}")
    key = s.api_key_env
    if key is not None and (not isinstance(key, str) or not _ENV_NAME.fullmatch(key)):
        return "serve.api_key_env", (f"must name an environment variable (letters, digits, _; the key itself "
                                     f"never goes in a recipe); got {key!r}")
    for name, low, strict in (("timeout_s", 0, True), ("reload_timeout_s", 0, True), ("wait_at_end_s", 0, False),
                              ("base_tolerance", 0, True)):
        problem = number_problem(f"serve.{name}", getattr(s, name), low, False, strict, None)
        if problem:
            return problem
    return flags_problem("serve", s, ("wait", "check_model", "adapter")) or _adapter_problem(s)


def _adapter_problem(s) -> Problem:
    """``serve.adapter_name`` and ``serve.keep_adapters``, which only adapter mode reads."""
    problem = number_problem("serve.keep_adapters", s.keep_adapters, 0, True, False, None)
    if problem:
        return problem[0], problem[1] + " (snapshots kept loaded under their own names)"
    name = s.adapter_name
    if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
        return "serve.adapter_name", (f"must be one word of letters, digits, '.', '_' or '-' (the model name clients "
                                      f"request); got {name!r}")
    if not s.adapter:
        for key, default in (("keep_adapters", 0), ("adapter_name", "latest")):
            if getattr(s, key) != default:
                return f"serve.{key}", "is set, but serve.adapter is false: set serve.adapter=true (a LoRA run's " \
                                       "adapters loaded into the engines) or leave it unset"
    return None


VERIFY_ALLOWANCE_S = 300.0
"""``serve.wait``: what a wait allows for verifying a snapshot before its swap, beyond :func:`swap_bound_s`."""


def swap_bound_s(timeout_s: float, reload_timeout_s: float) -> float:
    """The most one swap can take: every call at its timeout, a failed reload and its restore (the swap
    process's bound).

    >>> swap_bound_s(30, 600)
    1440
    """
    return 2 * (reload_timeout_s + timeout_s) + 6 * timeout_s


def format_engine_path(template: str, snapshot: str, name: str, step: int) -> str:
    """The snapshot's path as the engines see it.

    >>> format_engine_path("/models/{name}", "/data/run/hf-step-000008", "hf-step-000008", 8)
    '/models/hf-step-000008'
    """
    return template.format(snapshot=snapshot, name=name, step=step)


ADAPTER_DIRECTORY = "adapter"
"""Where a snapshot holds its PEFT adapter (``models/lora/adapter.DIRECTORY``; a test holds them equal)."""


def format_adapter_path(template: str, snapshot: str, name: str, step: int) -> str:
    """The snapshot's PEFT adapter directory as the engines see it (``serve.adapter``).

    >>> format_adapter_path("/models/{name}", "/data/run/hf-step-000008", "hf-step-000008", 8)
    '/models/hf-step-000008/adapter'
    """
    return f"{format_engine_path(template, snapshot, name, step).rstrip('/')}/{ADAPTER_DIRECTORY}"
