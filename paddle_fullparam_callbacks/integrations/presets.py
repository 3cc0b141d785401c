"""Name mappings (AOA configs) from Paddle model names/layouts to Hugging Face ones.

PaddleFormers models bring their own (``_gen_inv_aoa_config``); PaddleNLP 2.8 models use Paddle
names (``llama.layers.0...``) and Paddle's ``[in, out]`` Linear layout, so they get a preset:
a rename plus a transpose (``^T``) per Linear weight. Presets are AOA statements run through
Paddle's AOAEngine like any other mapping.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional

from ..config.schema import ConfigError


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    statements: Callable  # (tied: bool, source_keys) -> list[str]
    destination_pattern: str  # every destination name must match (catches unmapped sources)


def _llama_statements(prefix: str) -> Callable:
    def build(tied, source_keys) -> list:
        p = prefix
        L = "$LAYER_ID"
        out = [
            f"{p}.embed_tokens.weight -> model.embed_tokens.weight",
            f"{p}.norm.weight -> model.norm.weight",
        ]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(f"{p}.layers.{L}.{norm}.weight -> model.layers.{L}.{norm}.weight")
        for mod, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))):
            for proj in projs:
                src = f"{p}.layers.{L}.{mod}.{proj}_proj.weight"
                out.append(f"{src}^T -> model.layers.{L}.{mod}.{proj}_proj.weight")
        if "lm_head.weight" in source_keys:
            if tied:
                out.append("lm_head.weight -> _")
            else:
                out.append("lm_head.weight^T -> lm_head.weight")
        return out

    return build


PRESETS: Dict[str, Preset] = {
    "llama_paddlenlp": Preset(
        "llama_paddlenlp",
        "PaddleNLP 2.8 Llama (llama.* names, [in, out] Linear) -> HF LlamaForCausalLM",
        _llama_statements("llama"),
        r"^(model\.(embed_tokens|norm|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|input_layernorm|post_attention_layernorm))\.weight|lm_head\.weight)$",
    ),
}

# (module prefix, class name) -> preset used by aoa=auto for models without their own mapping
AUTO_PRESETS = {
    ("paddlenlp", "LlamaForCausalLM"): "llama_paddlenlp",
}


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


def resolve_mapping(spec, model, source_keys: Iterable[str], tied: bool = False) -> tuple:
    """Turn ``export.aoa`` into (aoa_config, destination_pattern or None).

    ``spec``: 'auto' | preset name | path to .json/.yaml | list of statements. ``tied``: the
    output embedding really is the input embedding (then lm_head.weight is not exported).
    """
    source_keys = list(source_keys)
    model_config = getattr(model, "config", None)
    if isinstance(spec, (list, tuple)):
        return {"aoa_statements": list(spec)}, None
    if spec == "auto":
        if hasattr(model, "_gen_inv_aoa_config"):
            cfg = dict(model._gen_inv_aoa_config(model_config))
            cfg["aoa_statements"] = _tie_statements(tied, source_keys, list(cfg.get("aoa_statements", [])))
            return cfg, None
        if hasattr(model, "_gen_aoa_config"):
            cfg = dict(model._gen_aoa_config(model_config))
            cfg["aoa_config_reverse"] = True
            return cfg, None
        key = (type(model).__module__.split(".")[0], type(model).__name__)
        preset = AUTO_PRESETS.get(key)
        if preset is None:
            raise ConfigError(
                "export.aoa",
                f"no Hugging Face name mapping is known for {key[0]}.{key[1]}: set export.aoa to a preset "
                f"({', '.join(PRESETS)}), a mapping file, or a list of statements; or use export.format=paddle_safetensors",
            )
        spec = preset
    if spec in PRESETS:
        p = PRESETS[spec]
        return {"aoa_statements": p.statements(tied, source_keys)}, p.destination_pattern
    path = Path(str(spec))
    if path.suffix in (".json", ".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError("export.aoa", f"mapping file {str(path)!r} does not exist")
        return _load_mapping_file(path), None
    raise ConfigError("export.aoa", f"unknown preset {spec!r}; presets: {', '.join(PRESETS)} (or give a .json/.yaml file)")


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
