"""The rule of ``evaluate.command`` (``schema.EvaluateConfig``): :func:`command_problem` finds None or what
is wrong with the command line, as the message of a ``ConfigError`` on that key. Pure."""
from __future__ import annotations

from typing import Any, Optional

from .rules import check_template

EVALUATE_FIELDS = ("snapshot", "step", "output", "python")


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
