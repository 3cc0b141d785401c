"""config.json as transformers writes it: one rule for every architecture and every level.

A framework's config serializes its own runtime machinery next to the architecture: PaddleFormers 1.2
writes nested sub-configs (``text_config``, ``vision_config``) with ``"torch_dtype": "None"``, an
empty ``quantization_config``, ``"return_dict": false``, parallel and fusion switches, about 150 keys
each. transformers 5 fails on the first two (``getattr(torch, "None")``; "no quant_method"), and
``return_dict: false`` breaks every forward of a multimodal model. :func:`describe` applies the same
rule to the top level and to each sub-config, whatever the architecture:

1. private keys (``_name``), ``paddleformers_version``/``transformers_version`` and values JSON cannot
   hold are dropped;
2. ``dtype`` / ``torch_dtype`` are dropped (the exporter writes one top-level ``dtype``, the
   snapshot's, as transformers does);
3. runtime switches (``return_dict``, ``use_cache``, ...) and generation settings are dropped (the
   loading class's defaults apply; generation settings go to generation_config.json);
4. a ``quantization_config`` that names no ``quant_method`` is dropped;
5. keys of the framework's generic ``PretrainedConfig`` are dropped when they hold its default, and
   parallel-degree keys always (a snapshot is one process's model); the keys transformers reads from
   every config (``model_type``, token ids, ``tie_word_embeddings``, ``architectures``) stay;
6. in a sub-config: ``architectures`` is dropped and ``tie_word_embeddings`` is the snapshot's real
   tie (transformers 5 turns the model's tie on when ``text_config`` says so);
7. activation names are spelled as transformers spells them (:data:`ACTIVATION_NAMES`);

Kept on purpose: keys transformers ignores but PaddleFormers reads back when it reloads the snapshot
(``fuse_rms_norm``: a reload on a CPU needs the unfused norm; ``rope_scaling`` beside
``rope_parameters``: PaddleOCR-VL's attention reads ``rope_scaling["mrope_section"]``; ``rope_theta``).
A text model's config.json is byte for byte what it was before this rule covered sub-configs.
"""
from __future__ import annotations

import json
import re
from typing import Optional

# runtime switches of the config that change what an HF model returns or how it runs; use_cache among
# them: the PaddleFormers Trainer sets it on the live config from TrainingArguments.use_cache (default
# False) while it trains, and a snapshot is for inference (left out, the loading class's default
# applies: the KV cache on)
RUNTIME_KEYS = ("return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_cache")
# generation settings belong in generation_config.json, not config.json (transformers >= 4.41 warns)
GENERATION_KEYS = (
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
)
# parallel-degree keys of PaddleFormers / PaddleNLP configs: a snapshot is a single-process model,
# so they take the framework's single-process default (a reload with tensor_model_parallel_size=2
# on one process fails in PaddleFormers)
PARALLEL_KEY = re.compile(
    r"^((tensor|pipeline|context|sep|expert|virtual_pipeline)_(model_)?parallel_(size|degree|rank)"
    r"|tensor_parallel_(degree|rank|output)|sequence_parallel|sep_parallel_(size|degree))$"
)
# keys of the frameworks' generic config base class that transformers reads too
HF_COMMON = {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"}
# PaddleFormers' activation names (paddleformers.nn.activation) that transformers spells otherwise, with
# the same values on [-6, 6] (PaddleOCR-VL's vision tower uses gelu_tanh = GELU(approximate="tanh"));
# every other PaddleFormers name exists in transformers with the same function
ACTIVATION_NAMES = {"gelu_tanh": "gelu_pytorch_tanh"}
_ACTIVATION_KEY = re.compile(r"(^|_)(hidden_act|act|activation|activation_function|hidden_activation)$")
_DROPPED = ("dtype", "torch_dtype", "paddleformers_version", "transformers_version")


def config_dict(config) -> dict:
    """The framework's own serialization of ``config`` (as its ``save_pretrained`` writes it)."""
    try:
        return dict(config.to_dict(saving_file=True))
    except TypeError:
        return dict(config.to_dict())


def generic_defaults(config) -> dict:
    """The framework's generic ``PretrainedConfig()`` values (training and parallel machinery)."""
    for cls in type(config).__mro__:
        if cls.__name__ == "PretrainedConfig":
            try:
                return config_dict(cls())
            except Exception:  # a framework whose base config needs arguments: keep everything
                return {}
    return {}


def is_config(value) -> bool:
    """A framework config object (a nested sub-config such as ``text_config``)."""
    return any(cls.__name__ == "PretrainedConfig" for cls in type(value).__mro__)


def _jsonable(obj) -> bool:
    try:
        json.dumps(obj)
        return True
    except (TypeError, ValueError):
        return False


def describe(config, tied: Optional[bool] = None, nested: bool = False) -> dict:
    """The rule of this module: ``config`` (a framework config object) as transformers would write it.

    Each sub-config is described by the same rule (``nested=True``). ``tied``: the snapshot's real
    tie, written into sub-configs (None: left as the framework says, e.g. before the tie is known).
    """
    raw = config_dict(config)
    base = generic_defaults(config)
    drop = set(RUNTIME_KEYS) | set(GENERATION_KEYS) | set(_DROPPED)
    out = {}
    for k, v in raw.items():
        live = getattr(config, k, None) if not k.startswith("_") else None
        if live is not None and is_config(live):
            out[k] = describe(live, tied, nested=True)
            continue
        if k.startswith("_") or k in drop or not _jsonable(v):
            continue
        if k == "quantization_config" and not (isinstance(v, dict) and v.get("quant_method")):
            continue  # an empty Paddle quantization config would make transformers try to quantize
        if k in base and k not in HF_COMMON and (PARALLEL_KEY.match(k) or v == base[k]):
            continue
        if nested and k == "architectures":
            continue
        if nested and k == "tie_word_embeddings" and tied is not None:
            v = bool(tied)
        if _ACTIVATION_KEY.search(k) and isinstance(v, str):
            v = ACTIVATION_NAMES.get(v, v)
        out[k] = v
    return out


# model types whose config.json transformers cannot load as the framework writes it, and that no rule of
# this module can make right: refused before the first byte (a preset that translates the config may
# still export them). Evidence: docs/models.md, "What is refused".
UNLOADABLE = {
    "ernie4_5_moe_vl": (
        "transformers 5.24 cannot load PaddleFormers' Ernie4.5-VL-MoE config.json (model_type 'ernie4_5_moe_vl'; "
        "transformers knows the architecture as 'ernie4_5_vl_moe', with nested text and vision configs whose keys "
        "differ: one expert count for both modalities, mrope_section instead of freq_allocation, the vision "
        "tower's hidden_size instead of embed_dim), and its model holds moe_statics.e_score_correction_bias "
        "tensors this model has only with moe_use_aux_free. A translation cannot be checked against Paddle's "
        "logits here (its forward needs GPU kernels), so no snapshot is written. Export Paddle names with "
        "export.format=paddle_safetensors, or give a preset that translates the config"
    ),
}


def check_loadable(config) -> None:
    """Refuse a model whose config.json transformers cannot load (:data:`UNLOADABLE`), with the reason."""
    from ..config.schema import ConfigError

    why = UNLOADABLE.get(getattr(config, "model_type", None) or getattr(type(config), "model_type", None))
    if why:
        raise ConfigError("export.format", f"{type(config).__name__}: {why}")


__all__ = ["ACTIVATION_NAMES", "UNLOADABLE", "check_loadable", "describe", "config_dict", "generic_defaults", "is_config"]
