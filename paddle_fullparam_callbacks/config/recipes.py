"""Loading recipes: bundled YAML files or paths, merged with ``key=value`` overrides."""
from __future__ import annotations

import atexit
import functools
import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from .schema import ConfigError, FullParamConfig

MAX_RECIPE_BYTES = 1_000_000
"""Largest recipe file, and largest override value (bundled recipes are a few hundred bytes)."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of mappings and lists (recipes need 3; omegaconf recurses ~10 frames a level)."""
MAX_YAML_NODES = 10_000
"""Most keys and values in one recipe or override (omegaconf builds ~15k nodes a second)."""


def recipes_dir() -> Path:
    """The folder of bundled recipes: ``recipes/`` inside the imported package (a wheel or sdist
    install, or a checkout on the path: the files ship as package data), found with
    :mod:`importlib.resources` whatever the working directory; ``$PFC_RECIPES_DIR`` replaces it."""
    env = os.environ.get("PFC_RECIPES_DIR")
    if env:
        return Path(env)
    return _bundled_recipes_dir(__name__.partition(".")[0])


@functools.lru_cache(maxsize=None)
def _bundled_recipes_dir(package: str) -> Path:
    from importlib.resources import files

    folder = files(package) / "recipes"
    if isinstance(folder, Path):  # a package on the file system, as pip installs it
        return folder
    # a package imported from an archive (zipimport): the recipes are copied out once per process
    out = Path(tempfile.mkdtemp(prefix="pfc-recipes-"))
    atexit.register(shutil.rmtree, out, True)
    for entry in folder.iterdir():
        if entry.name.endswith(".yaml") and entry.is_file():
            (out / entry.name).write_bytes(entry.read_bytes())
    return out


def list_recipes() -> list:
    """[(name, first comment line)] of the bundled recipes."""
    out = []
    for p in sorted(recipes_dir().glob("*.yaml")):
        desc = ""
        with open(p, "rb") as f:
            head = f.read(MAX_RECIPE_BYTES).decode("utf-8", errors="replace")
        for line in head.splitlines():
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


def read_recipe_text(path: "str | os.PathLike") -> str:
    """The text of a recipe file, refused before any YAML is built from it when it is larger than
    :data:`MAX_RECIPE_BYTES` or is YAML that could make loading slow (see :func:`check_yaml`)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)  # never more, whatever the file claims to be
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ConfigError("recipe", f"{path} cannot be read: {e.strerror or e}") from e
    if len(data) > MAX_RECIPE_BYTES:
        raise ConfigError(
            "recipe", f"{path} is {max(size, len(data))} bytes; a recipe may have at most {MAX_RECIPE_BYTES} "
                      "bytes (1MB)",
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("recipe", f"{path} does not parse as YAML: it is not UTF-8 text ({e})") from e
    check_yaml(text, "recipe", str(path))
    return text


def check_yaml(text: str, key: str, source: str) -> None:
    """Refuse YAML that could make loading it slow or deep, before omegaconf sees it.

    Walks yaml's own event parser, which never expands aliases and keeps no tree: anchors and
    aliases are refused (recipes need none, and nested aliases expand exponentially in omegaconf),
    as is nesting deeper than :data:`MAX_YAML_DEPTH` or more than :data:`MAX_YAML_NODES` nodes.
    Raises :class:`ConfigError` naming ``key``; ``source`` (a file, an override) leads the message.

    >>> check_yaml("trigger:\\n  every_n_steps: 5\\n", "recipe", "r.yaml")
    >>> check_yaml("a: &x [1]\\nb: *x\\n", "recipe", "r.yaml")
    Traceback (most recent call last):
    ...
    paddle_fullparam_callbacks.config.schema.ConfigError: recipe: r.yaml: YAML anchors/aliases are not allowed in recipes (line 1: &x); write the value out
    """
    depth = nodes = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.CollectionEndEvent, yaml.DocumentEndEvent)):
                depth -= isinstance(event, yaml.CollectionEndEvent)
                continue
            if not isinstance(event, yaml.NodeEvent):
                continue
            where = f"line {event.start_mark.line + 1}"
            anchor = getattr(event, "anchor", None)
            if isinstance(event, yaml.AliasEvent) or anchor is not None:
                sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
                raise ConfigError(
                    key, f"{source}: YAML anchors/aliases are not allowed in recipes ({where}: {sign}{anchor}); "
                         "write the value out",
                )
            nodes += 1
            if nodes > MAX_YAML_NODES:
                raise ConfigError(
                    key, f"{source}: more than {MAX_YAML_NODES} keys and values ({where}); a recipe needs a few "
                         "dozen (a long list of AOA statements goes in a .json/.yaml file named by export.aoa)",
                )
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise ConfigError(
                        key, f"{source}: nested deeper than {MAX_YAML_DEPTH} levels ({where}); recipes need 3",
                    )
    except yaml.YAMLError as e:
        raise ConfigError(key, f"{source} does not parse as YAML: {e}") from e


def _check_override(item: str) -> None:
    """Bounds of one ``key=value`` override (the value is YAML, read the same way as a recipe)."""
    key, value = item.split("=", 1)
    if len(item.encode("utf-8", errors="replace")) > MAX_RECIPE_BYTES:
        raise ConfigError(
            key[:80], f"the override is {len(item)} characters; at most {MAX_RECIPE_BYTES} bytes (1MB)",
        )
    if len(re.split(r"[.\[]", key)) > MAX_YAML_DEPTH:
        raise ConfigError(key[:80] + "...", f"the key is nested deeper than {MAX_YAML_DEPTH} levels; recipe keys have 2")
    check_yaml(value, key.strip(), "the override value")


def _text_field(key: str) -> bool:
    """Whether recipe key ``a.b`` is a text field of the schema (str or Optional[str])."""
    import dataclasses

    cls = FullParamConfig
    parts = key.strip().split(".")
    for i, part in enumerate(parts):
        field = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if field is None:
            return False
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if i == len(parts) - 1:
            return kind in ("str", "Optional[str]")
        cls = field.default_factory if callable(getattr(field, "default_factory", None)) else None
        if cls is None or not dataclasses.is_dataclass(cls):
            return False
    return False


def _as_text(item: str) -> str:
    """``export.name_template={step:06d}`` on a command line: YAML would read the value as a
    mapping; a text field takes it as the text it is (quoted values are left to YAML)."""
    key, value = item.split("=", 1)
    v = value.strip()
    if v[:1] in ("{", "[") and _text_field(key):
        return f"{key}='" + value.replace("'", "''") + "'"
    return item


def unknown_key_message(full_key: str) -> str:
    """'unknown key; trigger has: every_n_steps, on_save, ... (did you mean 'every_n_steps'?)' from
    the schema itself, whatever omegaconf's own message says."""
    import dataclasses
    import difflib

    cls, section = FullParamConfig, []
    parts = full_key.split(".")
    for part in parts[:-1]:
        field = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        sub = getattr(field, "default_factory", None) if field is not None else None
        if sub is None or not dataclasses.is_dataclass(sub):
            break
        cls, section = sub, section + [part]
    valid = [f.name for f in dataclasses.fields(cls)]
    wrong = parts[len(section)] if len(parts) > len(section) else full_key
    close = difflib.get_close_matches(wrong, valid, n=1, cutoff=0.6)
    prefix = ".".join(section) + "." if section else ""
    where = f"section {'.'.join(section)!r}" if section else "the top level"
    hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
    return f"unknown key; {where} has: {', '.join(valid)}.{hint}"


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
            text = read_recipe_text(path)
            try:
                loaded = OmegaConf.load(io.StringIO(text))
            except Exception as e:  # YAML syntax errors come as several types
                raise ConfigError("recipe", f"{path} does not parse as YAML: {e}") from e
            if not OmegaConf.is_dict(loaded):
                raise ConfigError("recipe", f"{path} must hold a mapping of keys, not {type(loaded).__name__}")
            layers.append(loaded)
        if overrides:
            for item in overrides:
                if "=" not in item or not item.split("=", 1)[0].strip():
                    raise ConfigError(str(item), "an override must be written key=value, e.g. trigger.every_n_steps=100")
                _check_override(_as_text(item))  # a text value starting with { is checked as the text it is
            layers.append(OmegaConf.from_dotlist([_as_text(item) for item in overrides]))
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
        if isinstance(e, ConfigKeyError) or ("Key '" in reason and "not in" in reason):
            reason = unknown_key_message(str(key))
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
