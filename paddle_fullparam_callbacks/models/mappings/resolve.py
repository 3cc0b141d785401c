"""``export.aoa`` -> the AOA config of one model: 'auto', a preset, a file, or statements.

``auto`` picks by class: a preset of this package registered for the model's class (or a class
it derives from) comes first, because it exists where the framework's own mapping is missing or
wrong; then the framework's own ``_gen_inv_aoa_config`` / ``_gen_aoa_config`` when the class
defines one. Nothing is guessed from parameter names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ...config.schema import ConfigError
from ..fleet import fleet_class, instance_attribute
from ..fleet import model_config as config_of  # the name model_config is a local variable below
from .base import AUTO, PRESETS, MappingContext, Preset
from .repairs_fused import linear_weight_names, repair_fused_splits


@dataclass
class ResolvedMapping:
    aoa_config: Optional[dict]
    source: str  # where it came from, recorded in the manifest: "preset llama_paddlenlp", ...
    preset: Optional[Preset] = None
    repairs: List[str] = field(default_factory=list)  # what was changed in a framework's own mapping, and why
    vouched: bool = False  # a preset's or the framework's own: every exported tensor must come from a statement

    @property
    def destination_pattern(self) -> Optional[str]:
        return self.preset.destination_pattern if self.preset else None


def _framework(cls) -> str:
    return cls.__module__.split(".")[0]


def auto_preset(model) -> Optional[Preset]:
    """The preset registered for the model's class or the nearest base class that has one; a
    pipeline model (``*ForCausalLMPipe``) is exported as its single-process class."""
    from ..pipe import plain_counterpart

    plain = plain_counterpart(model)
    for cls in type(model).__mro__ + (plain.__mro__ if plain is not None else ()):
        name = AUTO.get((_framework(cls), cls.__name__))
        if name:
            return PRESETS[name]
    return None


def _own_method(model, name: str):
    """A mapping method the model really has: set on the instance (a paddlefleet build, see
    ``models/fleet.py``) or defined by its class (not one conjured by a ``__getattr__`` that falls
    back to the config, as PaddleNLP's OPT does, returning None)."""
    own = instance_attribute(model, name)
    if callable(own):
        return own
    for cls in type(model).__mro__:
        if name in vars(cls):
            fn = getattr(model, name)
            return fn if callable(fn) else None
    return None


def _owner(model) -> type:
    return fleet_class(model) or type(model)


def known_architectures() -> str:
    rows = sorted(f"{fw}.{cls}" for fw, cls in AUTO)
    return ", ".join(rows)


_LM_HEAD_DROP = re.compile(r"^\s*lm_head\.weight\s*->\s*_\s*$")
_CAST = re.compile(r"\s*,\s*(src_dtype|dst_dtype|dtype)\s*=\s*['\"]?\w+['\"]?")


def _repair_framework_mapping(cfg: dict, tied: bool, source_keys: Dict[str, Tuple[int, ...]],
                              linear_weights: Optional[set] = None) -> Tuple[dict, List[str]]:
    """A framework's own mapping, made to export the model as it is.

    - Untied: a mapping that drops lm_head.weight (PaddleFormers 1.2 drops it whenever the config
      says tie_word_embeddings, although Qwen2-MoE, GPT-OSS, DeepSeek-V3, ... keep their own head)
      would make transformers tie a trained head to the embedding: export it instead.
    - Tied: left as the framework writes it. Some of its loaders need lm_head.weight in the
      file (PaddleFormers 1.2's Phi3); transformers ties a head equal to the embedding.
    - Casts: PaddleFormers 1.2's MoE mappings cast the router to bfloat16 inside an otherwise
      float32 snapshot, which changes routing; the snapshot's dtype is ``export.dtype``'s to set.
    """
    statements = list(cfg.get("aoa_statements", []))
    repairs = []
    if "lm_head.weight" in set(source_keys) and not tied and any(_LM_HEAD_DROP.match(s) for s in statements):
        statements = [("lm_head.weight -> lm_head.weight" if _LM_HEAD_DROP.match(s) else s) for s in statements]
        repairs.append("lm_head.weight exported (the model's LM head is its own weight; the mapping dropped it)")
    # fused splits of a Linear weight in Paddle's [in, out] layout: split first, then transpose each
    # part (repairs_fused.py: PaddleFormers 1.2's Phi3 and Glm4v-MoE)
    statements, fused = repair_fused_splits(statements, dict(source_keys), linear_weights)
    repairs += fused
    statements, idle = _drop_inapplicable(statements, set(source_keys))
    if idle:
        repairs.append(f"{len(idle)} statement(s) about tensors this model does not have removed, e.g. {idle[0]!r}")
    cast = [s for s in statements if _CAST.search(s)]
    if cast:
        statements = [_CAST.sub("", s) for s in statements]
        repairs.append(f"dtype casts removed from {len(cast)} statement(s) (export.dtype sets the snapshot's dtype), e.g. {cast[0]!r}")
    return {**cfg, "aoa_statements": statements}, repairs


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


_PLACEHOLDER = re.compile(r"\$[A-Z_]+")


def _names(side: str) -> List[str]:
    """Variable names of one side of a statement (attributes such as ``axis=1`` and macro tags left out)."""
    out = []
    for token in side.split(","):
        token = token.strip()
        if token and "=" not in token and "." in token:
            out.append(token[:-2] if token.endswith("^T") else token)
    return out


def _drop_inapplicable(statements: List[str], sources: set) -> Tuple[List[str], List[str]]:
    """Statements whose inputs this model can never have, removed.

    PaddleFormers 1.2's Ernie4_5_Moe mapping writes per-layer statements for its shared experts
    even when ``moe_num_shared_experts=0`` (AOAEngine then fails: "... should be assigned
    before"). Inputs are sources or outputs of statements that apply; a ``$LAYER_ID``-style
    statement applies to the sources its pattern matches. What is left is checked like any
    mapping (every destination filled exactly once, no Paddle name passed through).
    """
    available = set(sources)
    applies = [False] * len(statements)
    changed = True
    while changed:
        changed = False
        for i, stmt in enumerate(statements):
            if applies[i] or "->" not in stmt:
                continue
            left, right = stmt.split("->", 1)
            ins, outs = _names(left), _names(right)
            if not ins:
                applies[i] = True
                continue
            if _PLACEHOLDER.search(ins[0]):
                rx = re.compile("^" + _PLACEHOLDER.sub(r"(\\d+)", re.escape(ins[0]).replace(r"\$", "$")) + "$")
                ids = [m.groups() for m in map(rx.match, available) if m]
                if not ids:
                    continue
                for groups in ids:
                    for out in outs:
                        name = out
                        for g in groups:
                            name = _PLACEHOLDER.sub(g, name, count=1)
                        available.add(name)
            elif all(n in available for n in ins):
                available.update(outs)
            else:
                continue
            applies[i] = changed = True
    idle = [s for s, ok in zip(statements, applies) if not ok and "->" in s and not _PLACEHOLDER.search(s)]
    # placeholder statements that match nothing are harmless (AOAEngine expands them to nothing): keep them
    kept = [s for s, ok in zip(statements, applies) if ok or "->" not in s or _PLACEHOLDER.search(s)]
    return kept, idle


def _from_preset(preset: Preset, ctx: MappingContext) -> ResolvedMapping:
    return ResolvedMapping({"aoa_statements": preset.statements(ctx)}, f"preset {preset.name}", preset, vouched=True)


def resolve_mapping(spec, model, shapes: Dict[str, Tuple[int, ...]], tied: bool = False,
                    config: Optional[dict] = None, parallel: Optional[Dict[str, int]] = None) -> ResolvedMapping:
    """Turn ``export.aoa`` into the AOA config for ``model``.

    ``spec``: 'auto' | preset name | path to .json/.yaml | list of statements. ``shapes``: source
    tensor name -> global shape. ``tied``: the output embedding really is the input embedding (then
    lm_head.weight is not exported). ``config``: the model config as a dict (for presets).
    """
    ctx = MappingContext(dict(config or {}), tied, dict(shapes), dict(parallel or {}))
    if isinstance(spec, (list, tuple)):
        return ResolvedMapping({"aoa_statements": list(spec)}, "export.aoa statements")
    model_config = config_of(model)
    if spec == "auto":
        preset = auto_preset(model)
        if preset is not None:
            return _from_preset(preset, ctx)
        own = _own_method(model, "_gen_inv_aoa_config")
        if own is not None:
            cfg, repairs = _repair_framework_mapping(dict(own(model_config)), tied, shapes, linear_weight_names(model))
            return ResolvedMapping(cfg, f"{_owner(model).__name__}._gen_inv_aoa_config", repairs=repairs, vouched=True)
        own = _own_method(model, "_gen_aoa_config")
        if own is not None:
            cfg = dict(own(model_config))
            cfg["aoa_config_reverse"] = True
            return ResolvedMapping(cfg, f"{_owner(model).__name__}._gen_aoa_config (reversed)", vouched=True)
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
