"""The ``PADDLE_FULLPARAM_*`` environment variables: read, checked, written.

``paddle-fullparam run`` builds a :class:`RunSettings` from its flags over the environment it was
given, checks it (:meth:`RunSettings.load_config`, :func:`check_output_dir`) before starting COMMAND,
and hands it down with :meth:`RunSettings.to_environ`; every process that builds a Trainer reads it
back with :meth:`RunSettings.from_environ`. One set of rules for both, so a value ``run`` accepted is
never refused in a rank, and a value set by hand for a scheduler is checked the same way.

>>> s = RunSettings.from_environ({"PADDLE_FULLPARAM_RECIPE": "hf_every_n_steps",
...                               "PADDLE_FULLPARAM_OVERRIDES": "trigger.every_n_steps=2  retention.keep_last=1"})
>>> s.overrides
('trigger.every_n_steps=2', 'retention.keep_last=1')
>>> s.to_environ()["PADDLE_FULLPARAM_OVERRIDES"]
'trigger.every_n_steps=2 retention.keep_last=1'
"""
from __future__ import annotations

import os
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

from ...config.recipes import load_config, resolve_recipe
from ...config.schema import ConfigError, FullParamConfig
from .startup import OUTPUT_DIR, OVERRIDES, RECIPE

DEFAULT_RECIPE = "default"
"""``PADDLE_FULLPARAM_RECIPE=default``: the package's defaults (a snapshot at each trainer save and at
the end), no recipe file."""


@dataclass(frozen=True)
class RunSettings:
    recipe: str = DEFAULT_RECIPE
    """A bundled recipe name, a recipe file, or ``default``."""
    output_dir: Optional[str] = None
    """Where the snapshots go; None: the recipe's ``output_dir``, else ``<TrainingArguments.output_dir>/fullparam``."""
    overrides: Tuple[str, ...] = ()
    """``key=value`` recipe overrides, applied after the recipe (``output_dir`` comes last)."""

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "RunSettings":
        env = os.environ if environ is None else environ
        recipe = env.get(RECIPE, "").strip() or DEFAULT_RECIPE
        output_dir = env.get(OUTPUT_DIR, "").strip() or None
        return cls(recipe, output_dir, parse_overrides(env.get(OVERRIDES, "")))

    def with_flags(self, recipe: Optional[str] = None, output_dir: Optional[str] = None,
                   overrides: Sequence[str] = ()) -> "RunSettings":
        """``run``'s flags over the environment's values: --recipe and --output-dir replace, overrides add."""
        return replace(self, recipe=recipe if recipe else self.recipe,
                       output_dir=output_dir if output_dir else self.output_dir,
                       overrides=self.overrides + tuple(overrides))

    def all_overrides(self) -> list:
        return list(self.overrides) + ([f"output_dir={self.output_dir}"] if self.output_dir else [])

    def load_config(self) -> FullParamConfig:
        """The config every Trainer of the tree gets; :class:`ConfigError` naming the recipe key."""
        recipe = None if self.recipe == DEFAULT_RECIPE else self.recipe
        if recipe is not None:
            try:
                resolve_recipe(recipe)
            except ConfigError as e:
                raise ConfigError("recipe", f"{e.args[0].split(': ', 1)[1]} (or {DEFAULT_RECIPE!r} for the package's "
                                          "defaults)") from None
        return load_config(recipe, self.all_overrides())

    def absolute(self, cwd: Optional[str] = None) -> "RunSettings":
        """Paths made absolute against ``cwd``, as ``run`` hands them down (a rank may start elsewhere)."""
        base = Path(cwd or os.getcwd())
        recipe = self.recipe
        if recipe != DEFAULT_RECIPE and (base / recipe).is_file():
            recipe = str((base / recipe).resolve())
        out = str((base / Path(self.output_dir).expanduser()).resolve()) if self.output_dir else None
        return replace(self, recipe=recipe, output_dir=out)

    def to_environ(self) -> dict:
        env = {RECIPE: self.recipe, OVERRIDES: " ".join(shlex.quote(o) for o in self.overrides)}
        env[OUTPUT_DIR] = self.output_dir or ""
        return env

    def describe(self) -> str:
        parts = [f"recipe {self.recipe}"]
        if self.overrides:
            parts.append("overrides " + " ".join(self.overrides))
        return ", ".join(parts)


def parse_overrides(text: str) -> Tuple[str, ...]:
    """Whitespace-separated ``key=value`` items (shell quoting keeps a value with spaces in one item)."""
    try:
        items = shlex.split(text or "", comments=False, posix=True)
    except ValueError as e:
        raise ConfigError(OVERRIDES, f"{text!r} cannot be split into key=value items: {e}") from None
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(OVERRIDES, f"{item!r} is not key=value (items are whitespace-separated, e.g. "
                                         "'trigger.every_n_steps=100 retention.keep_last=3')")
    return tuple(items)


def check_output_dir(path: "str | os.PathLike") -> None:
    """Whether ``path`` is, or can be made, a writable directory, checked without making it: the nearest
    existing folder gets a probe file (removed at once). :class:`ConfigError` naming ``output_dir``."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError("output_dir", f"{str(p)!r} exists and is not a directory")
    existing = p
    while not existing.exists():
        if existing.is_symlink():
            raise ConfigError("output_dir", f"{str(existing)!r} is a dangling symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("output_dir", f"{str(p)!r} cannot be created: {str(existing)!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".paddle-fullparam-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "is not writable" if existing == p else f"cannot be created: {str(existing)!r} is not writable"
        raise ConfigError("output_dir", f"{str(p)!r} {what} ({e.strerror or e})") from None
