"""Rules more than one section of the config shares: a command line's ``{field}`` template and a bounded
number. Each finds None or the problem as ``(recipe key, message)``. Pure."""
from __future__ import annotations

import math
import shlex
import string
from typing import Any, Optional, Tuple

Problem = Optional[Tuple[str, str]]


def number_problem(key: str, value: Any, low: float, integer: bool, strict: bool, high: Optional[float]) -> Problem:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and math.isfinite(value) and (value > low if strict else value >= low) and (high is None or value <= high)
    if ok:
        return None
    bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    return key, f"must be {'a whole number' if integer else 'a number'} {bound}; got {value!r}"


def flags_problem(section: str, obj: Any, names: tuple) -> Problem:
    """The first of ``obj``'s attributes ``names`` that is not a boolean, as ``(section.name, message)``."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            return f"{section}.{name}", f"must be true or false; got {value!r}"
    return None


def check_template(key: str, text: Any, fields: tuple, example: str, what: str = "command") -> Problem:
    """A command line (or a ``what`` such as a path template) with ``{field}`` placeholders: it splits into
    words and names only ``fields``."""
    try:
        words = shlex.split(text) if isinstance(text, str) else []
    except ValueError as e:
        return key, f"does not split into words ({e}); got {text!r}"
    if not words:
        noun = "command line" if what == "command" else what
        return key, f"is empty; give a {noun} such as {example} (or leave it null); got {text!r}"
    for word in words:
        try:
            found = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(word) if f is not None]
        except ValueError as e:
            return key, f"{word!r}: {e} (write a literal brace as {{{{ or }}}})"
        for f, spec, conv in found:
            if f not in fields or spec or conv:
                return key, (f"{word!r}: unknown field {{{f}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}; "
                             f"the {what} may use " + ", ".join("{" + n + "}" for n in fields))
    return None
