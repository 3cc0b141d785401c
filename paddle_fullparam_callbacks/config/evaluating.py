"""The rules of the ``evaluate`` section (``consumers.EvaluateConfig``): :func:`command_problem` finds None or what
is wrong with ``evaluate.command``; :func:`lm_eval_problem` checks ``evaluate.lm_eval`` on its own and
:func:`lm_eval_against` against the rest of the recipe (its engine backend against ``serve``). Each problem is
``(recipe key, message)``. Pure: the tasks, their data files and the harness are proven at the start of training
(``consumers/evaluate/lmeval/check.py``)."""
from __future__ import annotations

import os
import re
from typing import Any, Optional, Tuple

from .rules import check_template, number_problem
from .serving import engine_urls

EVALUATE_FIELDS = ("snapshot", "step", "output", "python")
LM_EVAL_BACKENDS = ("hf", "engine")
"""``evaluate.lm_eval.backend``: transformers on the snapshot's files, or the engine that serves the snapshot."""
Problem = Optional[Tuple[str, str]]
_TASK = re.compile(r"[^\s,]+")


def command_problem(text: Any) -> Optional[str]:
    """None for a command line that splits into words whose only fields are :data:`EVALUATE_FIELDS`.

    >>> command_problem("{python} -m my_eval {snapshot} --output {output}") is None
    True
    >>> command_problem("run {snap}")
    "'{snap}': unknown field {snap}; the command may use {snapshot}, {step}, {output}, {python}"
    """
    problem = check_template("evaluate.command", text, EVALUATE_FIELDS,
                             "'{python} -m my_eval {snapshot} --output {output}'")
    return problem[1] if problem else None


def lm_eval_problem(s) -> Problem:
    """``evaluate.lm_eval`` on its own (``s`` is an ``LmEvalConfig``; ``include_path`` is made absolute and
    ``engine_url`` normalised in place).

    >>> from types import SimpleNamespace as NS
    >>> lm_eval_problem(NS(tasks=["a", "a"], include_path=None, builtin_tasks=False, num_fewshot=None, limit=None,
    ...                    batch_size=1, backend="hf", engine_url=None, engine_wait_s=300.0, log_samples=False,
    ...                    engine_hold=True))
    ('evaluate.lm_eval.tasks', "names 'a' twice; got ['a', 'a']")
    """
    tasks = s.tasks
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)) and type(tasks).__name__ != "ListConfig":
        return "evaluate.lm_eval.tasks", f"must be a list of task names (e.g. [pfc_choice, pfc_generate]); got {tasks!r}"
    tasks = list(tasks)
    for task in tasks:
        if not isinstance(task, str) or not _TASK.fullmatch(task):
            return "evaluate.lm_eval.tasks", f"{task!r} is not a task name (one word, no commas); got {tasks!r}"
        if tasks.count(task) > 1:
            return "evaluate.lm_eval.tasks", f"names {task!r} twice; got {tasks!r}"
    if not tasks:
        changed = [k for k, default in (("include_path", None), ("builtin_tasks", False), ("backend", "hf"),
                                        ("engine_url", None), ("num_fewshot", None), ("limit", None))
                   if getattr(s, k) != default]
        if changed:
            return "evaluate.lm_eval.tasks", (f"is empty, but evaluate.lm_eval.{changed[0]} is set: name the tasks to "
                                              "run (e.g. evaluate.lm_eval.tasks=[pfc_choice,pfc_generate])")
        return None
    if s.include_path is not None:
        if not isinstance(s.include_path, str) or not s.include_path.strip():
            return "evaluate.lm_eval.include_path", f"must be a folder of task files (or null: the bundled ones); got {s.include_path!r}"
        s.include_path = os.path.abspath(os.path.expanduser(s.include_path))  # the evaluator runs elsewhere
    for key in ("builtin_tasks", "log_samples", "engine_hold"):
        if not isinstance(getattr(s, key), bool):
            return f"evaluate.lm_eval.{key}", f"must be true or false; got {getattr(s, key)!r}"
    if s.num_fewshot is not None:
        problem = number_problem("evaluate.lm_eval.num_fewshot", s.num_fewshot, 0, True, False, None)
        if problem:
            return problem[0], problem[1] + " (or null: each task's own)"
    limit = s.limit
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0 or (
                limit >= 1 and float(limit) != int(limit)):
            return "evaluate.lm_eval.limit", (f"must be a number of documents per task (a whole number >= 1), a "
                                              f"fraction of them (0 < limit < 1), or null (all); got {limit!r}")
    problem = number_problem("evaluate.lm_eval.batch_size", s.batch_size, 1, True, False, None)
    if problem:
        return problem
    if isinstance(s.backend, bool) or s.backend not in LM_EVAL_BACKENDS:
        return "evaluate.lm_eval.backend", f"must be one of {', '.join(LM_EVAL_BACKENDS)}; got {s.backend!r}"
    problem = number_problem("evaluate.lm_eval.engine_wait_s", s.engine_wait_s, 0, False, False, None)
    if problem:
        return problem
    if s.engine_url is not None:
        if s.backend != "engine":
            return "evaluate.lm_eval.engine_url", "is set, but evaluate.lm_eval.backend is hf: set backend=engine to use it"
        try:
            (s.engine_url,) = engine_urls([s.engine_url])
        except ValueError as e:
            return "evaluate.lm_eval.engine_url", str(e)
    return None


def lm_eval_against(evaluate, serve) -> Problem:
    """``evaluate.lm_eval`` against the rest of the recipe: one evaluator, and the engine backend's engine among
    ``serve.url`` (``engine_url`` defaults to the first one, set in place)."""
    s = evaluate.lm_eval
    if not s.tasks:
        return None
    if evaluate.command is not None or evaluate.callable is not None:
        other = "evaluate.command" if evaluate.command is not None else "evaluate.callable"
        return "evaluate.lm_eval.tasks", f"is set together with {other}: give one evaluator (unset {other})"
    if s.backend != "engine":
        return None
    if not serve.enabled:
        return "evaluate.lm_eval.backend", ("engine scores each snapshot on the engine that serves it, but the recipe "
                                            "has no serve section: set serve.url (the engines every snapshot is "
                                            "switched into), or use backend=hf")
    if s.engine_url is None:
        s.engine_url = serve.urls[0]
    elif s.engine_url not in serve.urls:
        return "evaluate.lm_eval.engine_url", (f"{s.engine_url} is not one of serve.url ({', '.join(serve.urls)}): "
                                               "the engine backend scores a snapshot on an engine the job serves it on")
    return None
