"""``export.aoa`` -> the AOA config of one model: 'auto', a preset, a file, or statements.

``auto`` picks by class: a preset of this package registered for the model's class (or a class
it derives from) comes first, because it exists where the framework's own mapping is missing or
wrong; then the framework's own ``_gen_inv_aoa_config`` / ``_gen_aoa_config`` when the class
defines one. Nothing is guessed from parameter names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

from ...config.schema import ConfigError
from .base import AUTO, PRESETS, MappingContext, Preset


@dataclass
class ResolvedMapping:
    aoa_config: Optional[dict]
    source: str  # where it came from, recorded in the manifest: "preset llama_paddlenlp", ...
    preset: Optional[Preset] = None

    @property
    def destination_pattern(self) -> Optional[str]:
        return self.preset.destination_pattern if self.preset else None


def _framework(cls) -> str:
    return cls.__module__.split(".")[0]


def auto_preset(model) -> Optional[Preset]:
    """The preset registered for the model's class or the nearest base class that has one."""
    for cls in type(model).__mro__:
        name = AUTO.get((_framework(cls), cls.__name__))
        if name:
            return PRESETS[name]
    return None


def _own_method(model, name: str):
    """A mapping method the model's class really defines (not one conjured by a ``__getattr__``
    that falls back to the config, as PaddleNLP's OPT does, returning None)."""
    for cls in type(model).__mro__:
        if name in vars(cls):
            fn = getattr(model, name)
            return fn if callable(fn) else None
    return None


def known_architectures() -> str:
    rows = sorted(f"{fw}.{cls}" for fw, cls in AUTO)
    return ", ".join(rows)


def _tie_statements(tied: bool, source_keys: Iterable[str], statements: list) -> list:
    """With tied embeddings the HF file has no lm_head.weight (transformers ties it on load)."""
    if "lm_head.weight" in set(source_keys) and tied:
        if not any(re.search(r"(^|\s)lm_head\.weight(\^T)?\s*->", s) for s in statements):
            return statements + ["lm_head.weight -> _"]
    return statements


def _load_mapping_file(path: Path) -> dict:
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            from omegaconf import OmegaConf

            obj = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
        else:
            obj = json.loads(text)
    except Exception as e:  # parse errors of both formats
        raise ConfigError("export.aoa", f"mapping file {str(path)!r} does not parse: {e}") from e
    if isinstance(obj, list):
        obj = {"aoa_statements": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("aoa_statements"), list) or not all(
        isinstance(s, str) for s in obj["aoa_statements"]
    ):
        raise ConfigError(
            "export.aoa",
            f"mapping file {str(path)!r} must hold a list of statements or {{'aoa_statements': [...], 'aoa_config_reverse': bool}}",
        )
    return {"aoa_statements": list(obj["aoa_statements"]), "aoa_config_reverse": bool(obj.get("aoa_config_reverse", False))}


def _from_preset(preset: Preset, ctx: MappingContext) -> ResolvedMapping:
    return ResolvedMapping({"aoa_statements": preset.statements(ctx)}, f"preset {preset.name}", preset)


def resolve_mapping(spec, model, shapes: Dict[str, Tuple[int, ...]], tied: bool = False,
                    config: Optional[dict] = None) -> ResolvedMapping:
    """Turn ``export.aoa`` into the AOA config for ``model``.

    ``spec``: 'auto' | preset name | path to .json/.yaml | list of statements. ``shapes``: source
    tensor name -> global shape. ``tied``: the output embedding really is the input embedding (then
    lm_head.weight is not exported). ``config``: the model config as a dict (for presets).
    """
    ctx = MappingContext(dict(config or {}), tied, dict(shapes))
    if isinstance(spec, (list, tuple)):
        return ResolvedMapping({"aoa_statements": list(spec)}, "export.aoa statements")
    model_config = getattr(model, "config", None)
    if spec == "auto":
        preset = auto_preset(model)
        if preset is not None:
            return _from_preset(preset, ctx)
        own = _own_method(model, "_gen_inv_aoa_config")
        if own is not None:
            cfg = dict(own(model_config))
            cfg["aoa_statements"] = _tie_statements(tied, shapes, list(cfg.get("aoa_statements", [])))
            return ResolvedMapping(cfg, f"{type(model).__name__}._gen_inv_aoa_config")
        own = _own_method(model, "_gen_aoa_config")
        if own is not None:
            cfg = dict(own(model_config))
            cfg["aoa_config_reverse"] = True
            return ResolvedMapping(cfg, f"{type(model).__name__}._gen_aoa_config (reversed)")
        cls = type(model)
        raise ConfigError(
            "export.aoa",
            f"no Hugging Face name mapping is known for {_framework(cls)}.{cls.__name__}. Mappings ship for "
            f"{known_architectures()}, and for PaddleFormers models that define their own (_gen_inv_aoa_config). "
            "Give one as export.aoa: a preset name, a .json/.yaml file holding a list of AOA statements "
            "(e.g. [\"gpt.embeddings.word_embeddings.weight -> transformer.wte.weight\", \"...weight^T -> ...\"]), "
            "or the list itself; or export Paddle names with export.format=paddle_safetensors",
        )
    if spec in PRESETS:
        return _from_preset(PRESETS[spec], ctx)
    path = Path(str(spec))
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError("export.aoa", f"mapping file {str(path)!r} does not exist")
        return ResolvedMapping(_load_mapping_file(path), f"file {path}")
    raise ConfigError("export.aoa", f"unknown preset {spec!r}; presets: {', '.join(sorted(PRESETS))} (or give a .json/.yaml file)")


def check_destination_names(names: Iterable[str], pattern: Optional[str], spec) -> None:
    """A preset's destinations must all look like HF names: a source it did not map is an error."""
    if not pattern:
        return
    rx = re.compile(pattern)
    bad = sorted(n for n in names if not rx.match(n))
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ConfigError(
            "export.aoa",
            f"preset {spec!r} leaves tensor(s) {bad[:3]}{more} unmapped (is the model fused or of another family?); "
            "give a mapping file that covers them",
        )
