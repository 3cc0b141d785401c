"""Loading recipes: bundled YAML files or paths, merged with ``key=value`` overrides."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema import ConfigError, FullParamConfig


def recipes_dir() -> Path:
    """The folder of bundled recipes (``recipes/`` of the project, or $PFC_RECIPES_DIR)."""
    env = os.environ.get("PFC_RECIPES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "recipes"


def list_recipes() -> list:
    """[(name, first comment line)] of the bundled recipes."""
    out = []
    for p in sorted(recipes_dir().glob("*.yaml")):
        desc = ""
        for line in p.read_text().splitlines():
            if line.startswith("#"):
                desc = line.lstrip("# ").strip()
                break
        out.append((p.stem, desc))
    return out


def resolve_recipe(recipe: "str | os.PathLike") -> Path:
    """A path, or the name of a bundled recipe (with or without .yaml)."""
    p = Path(recipe)
    if p.is_file():
        return p
    for candidate in (recipes_dir() / f"{recipe}.yaml", recipes_dir() / str(recipe)):
        if candidate.is_file():
            return candidate
    names = ", ".join(n for n, _ in list_recipes()) or "(none found)"
    raise ConfigError("recipe", f"no recipe file {str(recipe)!r}; bundled recipes: {names}")


def _error_key(e: OmegaConfBaseException) -> str:
    return getattr(e, "full_key", None) or getattr(e, "key", None) or "recipe"


def load_config(
    recipe: "str | os.PathLike | None" = None,
    overrides: Optional[Sequence[str]] = None,
    *,
    base: "dict | FullParamConfig | None" = None,
) -> FullParamConfig:
    """Load a recipe (bundled name or path), apply ``key=value`` overrides, validate, return the config.

    ``base`` (a dict of recipe keys or a config object) is merged first, in place of a recipe.
    Unknown keys, wrong types and bad values raise :class:`ConfigError` naming the key.
    Interpolations are not allowed (a recipe is data, never code).

    >>> load_config(None, ["trigger.every_n_steps=5"]).trigger.every_n_steps
    5
    """
    layers = [OmegaConf.structured(FullParamConfig)]
    try:
        if base is not None:
            layers.append(OmegaConf.structured(base) if isinstance(base, FullParamConfig) else OmegaConf.create(base))
        if recipe is not None:
            path = resolve_recipe(recipe)
            try:
                loaded = OmegaConf.load(path)
            except Exception as e:  # YAML syntax errors come as several types
                raise ConfigError("recipe", f"{path} does not parse as YAML: {e}") from e
            if not OmegaConf.is_dict(loaded):
                raise ConfigError("recipe", f"{path} must hold a mapping of keys, not {type(loaded).__name__}")
            layers.append(loaded)
        if overrides:
            for item in overrides:
                if "=" not in item or not item.split("=", 1)[0].strip():
                    raise ConfigError(str(item), "an override must be written key=value, e.g. trigger.every_n_steps=100")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        for layer in layers[1:]:
            _reject_interpolations(layer)
            _check_sections(layer)
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        key = _error_key(e)
        reason = str(e).splitlines()[0]
        if "not in" in reason or "Key '" in reason and "not" in reason:
            reason = f"unknown key ({reason})"
        raise ConfigError(str(key), reason) from e


def _check_sections(layer) -> None:
    """A section (trigger, export, ...) given a plain value: omegaconf's error names no key."""
    import dataclasses

    sections = {f.name for f in dataclasses.fields(FullParamConfig)
                if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    for key in layer:
        if key in sections and not OmegaConf.is_dict(layer._get_node(key)):
            raise ConfigError(str(key), f"is a section of keys, not a value; set its keys, e.g. {key}.<key>=...")


def _reject_interpolations(node, prefix: str = "") -> None:
    for key in node:
        full = f"{prefix}{key}"
        if OmegaConf.is_interpolation(node, key):
            raise ConfigError(full, "interpolations (${...}) are not allowed in recipes")
        value = node._get_node(key)
        if OmegaConf.is_dict(value):
            _reject_interpolations(value, full + ".")


def to_yaml(config: FullParamConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def coerce_config(
    config: "FullParamConfig | str | os.PathLike | dict | None", overrides: Iterable[str] = ()
) -> FullParamConfig:
    """Accept a config object, a recipe (name/path), a plain dict, or None (defaults)."""
    overrides = list(overrides)
    if isinstance(config, FullParamConfig) and not overrides:
        return config
    if isinstance(config, (FullParamConfig, dict)):
        return load_config(None, overrides, base=config)
    return load_config(config, overrides)
