"""The one error of the config layer and the checks every section shares: each message names the recipe key."""
from __future__ import annotations

import math
from typing import Any, Optional


class ConfigError(ValueError):
    """A recipe or config value is wrong; ``key`` is the dotted recipe key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def check_choice(key: str, value: Any, choices: tuple) -> None:
    # `on_error: NO` in YAML is the boolean false, not the text "NO" (omegaconf hands a text field 'False')
    if isinstance(value, bool) or (value in ("True", "False") and value not in choices):
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got the YAML boolean {str(value).lower()} "
                               "(unquoted yes/no/on/off/true/false are booleans in YAML)")
    if value not in choices:
        raise ConfigError(key, f"must be one of {', '.join(choices)}; got {value!r}")


def check_number(key: str, value: Any, low: float, *, integer: bool = False, strict: bool = False,
                 high: Optional[float] = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and math.isfinite(value) and (value > low if strict else value >= low) and (high is None or value <= high)
    if not ok:
        what = "a whole number" if integer else "a number of seconds"
        bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ConfigError(key, f"must be {what} {bound}; got {value!r}")
