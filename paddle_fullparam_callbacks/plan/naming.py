"""Snapshot directory names: formatting a template and proving it stays inside output_dir."""
from __future__ import annotations

import re

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")


def format_snapshot_name(template: str, step: int) -> str:
    """Format the snapshot name of ``step``; raise ValueError if it is not one safe path component.

    >>> format_snapshot_name("hf-step-{step:06d}", 500)
    'hf-step-000500'
    """
    try:
        name = template.format(step=step)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"name template {template!r} must use only the field {{step}} (e.g. 'hf-step-{{step:06d}}'): {e!r}"
        ) from e
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ValueError(
            f"name template {template!r} gives {name!r} for step {step}: a snapshot name must be one "
            "directory name made of letters, digits and . _ + = - (no '/', no '..', not absolute, "
            "not starting with '.')"
        )
    return name


def validate_template(template: str) -> None:
    """Raise ValueError unless the template makes a safe, step-dependent name."""
    first = format_snapshot_name(template, 0)
    second = format_snapshot_name(template, 123456789)
    if first == second:
        raise ValueError(f"name template {template!r} does not depend on the step; include {{step}}")


def snapshot_step_pattern(template: str) -> "re.Pattern[str]":
    """A regex that matches names this template produces, capturing the step."""
    marker = "\0STEP\0"
    probe = re.sub(r"\{step(:[^}]*)?\}", marker, template)
    return re.compile("^" + re.escape(probe).replace(re.escape(marker), r"(\d+)") + "$")
