"""The rule of ``evaluate.command`` (``schema.EvaluateConfig``): :func:`command_problem` finds None or what
is wrong with the command line, as the message of a ``ConfigError`` on that key. Pure."""
from __future__ import annotations

import shlex
import string
from typing import Any, Optional

EVALUATE_FIELDS = ("snapshot", "step", "output", "python")


def command_problem(text: Any) -> Optional[str]:
    """None for a command line that splits into words whose only fields are :data:`EVALUATE_FIELDS`.

    >>> command_problem("{python} -m my_eval {snapshot} --output {output}") is None
    True
    >>> command_problem("run {snap}")
    "'{snap}': unknown field {snap}; the command may use {snapshot}, {step}, {output}, {python}"
    """
    try:
        words = shlex.split(text) if isinstance(text, str) else []
    except ValueError as e:
        return f"does not split into words ({e}); got {text!r}"
    if not words:
        return (f"is empty; give a command line such as '{{python}} -m my_eval {{snapshot}} "
                f"--output {{output}}' (or leave it null); got {text!r}")
    for word in words:
        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(word) if f is not None]
        except ValueError as e:
            return f"{word!r}: {e} (write a literal brace as {{{{ or }}}})"
        for f, spec, conv in fields:
            if f not in EVALUATE_FIELDS or spec or conv:
                return (f"{word!r}: unknown field {{{f}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}; "
                        "the command may use " + ", ".join("{" + n + "}" for n in EVALUATE_FIELDS))
    return None
