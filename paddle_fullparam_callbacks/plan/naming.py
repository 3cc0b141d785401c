"""Snapshot directory names: the ``export.name_template`` contract.

A template such as ``hf-step-{step:06d}`` names the snapshot of each step. Retention and ``best``
find snapshots by reading the step back from a directory name (:func:`snapshot_step_pattern`),
never by comparing names as strings, so a template must keep these promises for every step from 0
to :data:`MAX_STEP` (checked by :func:`validate_template` when the config is loaded):

- exactly one field, ``{step}``, formatted as a decimal integer (``{step}``, ``{step:d}``,
  ``{step:0Nd}``); no other field, no conversion (``!r``/``!s``/``!a``);
- distinct steps give distinct names, and the pattern reads each name back as exactly its step;
- each name is one safe directory name of at most :data:`MAX_NAME_BYTES` bytes;
- names sort as plain strings (``ls``) in step order up to :func:`sort_bound` (``10**N - 1`` for
  ``{step:0Nd}``: 999999 for the default; 9 for ``{step}``). Beyond it only listings change order.
"""
from __future__ import annotations

import functools
import random
import re
import string
from typing import Callable, Iterable, Optional

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")

MAX_STEP = 2**63 - 1
"""Largest step a template must name (a trainer's step counter is an int64)."""
MAX_NAME_BYTES = 200
"""Longest snapshot name: the commit adds up to 19 bytes (``.replaced-`` and ``-<8 hex>``) for its
staging and trash entries, which must stay within the 255-byte limit of a file name."""
_RESERVED = ("latest", "best")  # the pointer files next to the snapshots (export/commit/pointers.py POINTERS)
_EXAMPLE = "'hf-step-{step:06d}'"


def name_problem(name: str) -> Optional[str]:
    """Why ``name`` is not one safe snapshot directory name inside output_dir (None if it is).

    >>> name_problem("hf-step-000500") is None
    True
    >>> name_problem(".hidden-1")
    "it starts with '.' (dot-names in output_dir are the staging, trash and lock entries)"
    """
    if "/" in name or "\\" in name:
        return "no '/' or '\\' allowed: a snapshot name is one path component inside output_dir"
    if "\0" in name:
        return "it contains a NUL character"
    if name in ("", ".", ".."):
        return f"{name!r} is not a directory name"
    if name.startswith("."):
        return "it starts with '.' (dot-names in output_dir are the staging, trash and lock entries)"
    if not name.isprintable() or name != name.strip():
        return "it has spaces at an end or characters that do not print"
    if not _SAFE_NAME.match(name):
        return "a snapshot name is made of letters, digits and . _ + = -, starting with a letter or digit"
    if name in _RESERVED:
        return f"{name!r} is the pointer file next to the snapshots"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"it is {len(name.encode('utf-8'))} bytes long; the limit is {MAX_NAME_BYTES}"
    return None


def format_snapshot_name(template: str, step: int) -> str:
    """Format the snapshot name of ``step``; raise ValueError if it is not one safe path component.

    >>> format_snapshot_name("hf-step-{step:06d}", 500)
    'hf-step-000500'
    """
    try:
        name = template.format(step=step)
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        raise ValueError(
            f"name template {template!r} must use only the field {{step}} (e.g. {_EXAMPLE}): {e!r}"
        ) from e
    problem = name_problem(name)
    if problem:
        raise ValueError(f"name template {template!r} gives {name!r} for step {step}: {problem}")
    return name


def snapshot_step_pattern(template: str) -> "re.Pattern[str]":
    """The regex that matches exactly the names this template produces, capturing the step.

    The step group accepts only the template's own rendering (``{step:06d}``: six digits below
    10**6, no leading zero above), so ``hf-step-0500`` is not taken for step 500.

    >>> p = snapshot_step_pattern("hf-step-{step:06d}")
    >>> int(p.match("hf-step-000500").group(1)), p.match("hf-step-0500")
    (500, None)
    """
    problem = _structure_problem(template)
    if problem:
        raise ValueError(f"name template {template!r}: {problem}")
    parts = []
    for literal, field, spec, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(_step_group(spec))
    return re.compile("^" + "".join(parts) + "$")


def sort_bound(template: str) -> int:
    """Largest step up to which the names sort as plain strings in step order (0 for a template
    whose step is not rendered as zero-padded decimal digits).

    >>> sort_bound("hf-step-{step:06d}"), sort_bound("hf-{step}")
    (999999, 9)
    """
    specs = [s for _, f, s, _ in string.Formatter().parse(template) if f is not None]
    width = _field_width(specs[0]) if len(specs) == 1 else None
    return min(10**width - 1, MAX_STEP) if width else 0


def validate_template(template: str) -> None:
    """Raise ValueError, naming an example that breaks it, unless ``template`` keeps the naming contract.

    >>> validate_template("hf-step-{step:06d}")
    >>> validate_template("hf-{step:_}")
    Traceback (most recent call last):
    ...
    ValueError: step 1000 gives 'hf-1_000', which the snapshot pattern does not match (retention and `best` find snapshots by the step in their name)
    """
    if not isinstance(template, str):
        raise ValueError(f"must be a string such as {_EXAMPLE}; got {template!r}")
    problem = _template_problem(template)
    if problem:
        raise ValueError(problem)


@functools.lru_cache(maxsize=64)
def _template_problem(template: str) -> Optional[str]:
    problem = _structure_problem(template)
    if problem:
        return problem
    spec = next(s for _, f, s, _ in string.Formatter().parse(template) if f is not None)
    violation = _first_violation(
        lambda step: template.format(step=step), snapshot_step_pattern(template), sort_bound(template), _PROBES,
    )
    if _presentation(spec) not in ("", "d"):
        # 'n' follows the locale, the others are not decimal: refused even where the probes pass
        return (f"{template!r} formats the step with {':' + spec!r}, not as a decimal integer"
                + (f": {violation}" if violation else "")
                + f". Use {{step}}, {{step:d}} or {{step:0Nd}}, e.g. {_EXAMPLE}")
    return violation


def _structure_problem(template: str) -> Optional[str]:
    """The rules on the fields of the template: exactly one ``{step}``, no conversion, no other field."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"{template!r} is not a format string: {e}"
    steps = 0
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if field != "step":
            return f"{template!r} may use only the field {{step}}; it has {{{field}}}"
        try:
            nested = [f for _, f, _, _ in string.Formatter().parse(spec or "") if f is not None]
        except ValueError as e:
            return f"{template!r} has a format spec {spec!r} that does not parse: {e}"
        if nested:
            return f"{template!r} may use only the field {{step}}; it has {{{nested[0]}}} inside {{step:{spec}}}"
        if conversion:
            return f"{template!r} converts the step with !{conversion}; drop the conversion (write {{step}} or {{step:06d}})"
        steps += 1
    if steps == 0:
        return f"{template!r} does not depend on the step; include {{step}}, e.g. {_EXAMPLE}"
    if steps > 1:
        return f"{template!r} has {{step}} {steps} times; use it exactly once"
    return None


def _presentation(spec: str) -> str:
    """The presentation type of a format spec (its last character when that is a letter or '%')."""
    return spec[-1:] if spec[-1:].isalpha() or spec[-1:] == "%" else ""


def _field_width(spec: str) -> Optional[int]:
    """Digits of step 0 under ``spec`` (its zero-padded width); None unless a decimal rendering."""
    if _presentation(spec) not in ("", "d"):
        return None
    try:
        zero = format(0, spec)
    except ValueError:
        return None
    return len(zero) if zero.isascii() and zero.isdigit() else None


def _step_group(spec: str) -> str:
    width = _field_width(spec)
    if width is None:
        return "([0-9]+)"  # not a decimal rendering; validate_template refuses such templates
    return f"([0-9]{{{width}}}|[1-9][0-9]{{{width},}})"


def _first_violation(fmt: Callable[[int], str], pattern: "re.Pattern[str]", bound: int,
                     steps: Iterable[int]) -> Optional[str]:
    """The first broken promise over ``steps`` (ascending), as a message with the example; None if none.

    Each name is checked on its own first (formats, length, safe), then against the others
    (distinct), then read back (the pattern), then in order (sorted up to ``bound``).
    """
    names = []
    seen = {}
    for step in steps:
        try:
            name = fmt(step)
        except (ValueError, TypeError) as e:
            return f"formatting step {step} fails: {e}"
        size = len(name.encode("utf-8"))
        if size > MAX_NAME_BYTES:
            return (f"step {step} gives a name of {size} bytes ({name[:24]!r}...); names may have at most "
                    f"{MAX_NAME_BYTES} bytes for every step up to {MAX_STEP}")
        problem = name_problem(name)
        if problem:
            return f"step {step} gives {name!r}, which is not one safe directory name: {problem}"
        if name in seen:
            return f"steps {seen[name]} and {step} both give {name!r} (names must be distinct)"
        seen[name] = step
        names.append((step, name))
    for step, name in names:
        m = pattern.match(name)
        if m is None or int(m.group(1)) != step:
            back = "does not match" if m is None else f"reads back as step {int(m.group(1))}"
            return (f"step {step} gives {name!r}, which the snapshot pattern {back} "
                    "(retention and `best` find snapshots by the step in their name)")
    listed = [(step, name) for step, name in names if step <= bound]
    for (a, x), (b, y) in zip(listed, listed[1:]):
        if not x < y:
            return (f"steps {a} and {b} give {x!r} and {y!r}, which sort the other way as strings "
                    f"(names must sort in step order up to step {bound})")
    return None


def _probe_steps() -> tuple:
    """Steps every template is tried on: 0..1000, each power of 10 and of 2 and their neighbours,
    random steps of every length (fixed seed: every rank and every run checks the same), MAX_STEP."""
    steps = set(range(1001))
    for k in range(1, 20):
        steps |= {10**k - 1, 10**k, 10**k + 1}
    for k in range(1, 64):
        steps |= {2**k - 1, 2**k, 2**k + 1}
    rng = random.Random(9)
    for digits in range(1, 20):
        steps |= {rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(8)}
    return tuple(sorted(s for s in steps if 0 <= s <= MAX_STEP))


_PROBES = _probe_steps()
