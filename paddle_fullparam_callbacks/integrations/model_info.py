"""What the exporter needs from a live model: its sharded state dict, mapping, HF config."""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

from ..config.schema import FullParamConfig
from ..export.runner import ModelSource
from .presets import check_destination_names, resolve_mapping

logger = logging.getLogger("paddle_fullparam_callbacks")


def unwrap_model(model):
    """The user's Layer inside DataParallel / fleet / PipelineParallel wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_layers", None) or getattr(model, "_layer", None)
        if inner is None:
            break
        model = inner
    return model


def framework_of(model) -> str:
    root = type(model).__module__.split(".")[0]
    return root if root in ("paddleformers", "paddlenlp") else "paddle"


# runtime switches of the Paddle config that would change what an HF model returns
_RUNTIME_KEYS = ("return_dict", "output_hidden_states", "output_attentions", "torchscript")
# generation settings belong in generation_config.json, not config.json (transformers >= 4.41 warns)
_GENERATION_KEYS = (
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
)


def _jsonable(obj):
    try:
        json.dumps(obj)
        return True
    except (TypeError, ValueError):
        return False


def weights_tied(model) -> bool:
    """Whether the output embedding *is* the input embedding (not just what the config claims).

    PaddleNLP 2.8's Llama accepts ``tie_word_embeddings=True`` but keeps a separate LM head, so
    the config flag alone would make the snapshot drop a weight the model uses.
    """
    config = getattr(model, "config", None)
    claimed = bool(getattr(config, "tie_word_embeddings", False))
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return claimed
    if inp is None or out is None:
        return claimed
    a, b = getattr(inp, "weight", None), getattr(out, "weight", None)
    if a is None or b is None:
        return claimed
    tied = a is b
    if claimed and not tied:
        logger.warning(
            "%s: config says tie_word_embeddings=True but the LM head has its own weight; "
            "exporting lm_head.weight and writing tie_word_embeddings=false", type(model).__name__,
        )
    return tied


def hf_config_dict(model, tied: bool) -> Optional[dict]:
    """config.json content for transformers: the model config with HF's required keys set."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        raw = config.to_dict(saving_file=True)
    except TypeError:
        raw = config.to_dict()
    drop = set(_RUNTIME_KEYS) | set(_GENERATION_KEYS)
    out = {k: v for k, v in raw.items() if not k.startswith("_") and k not in drop and _jsonable(v)}
    q = out.get("quantization_config")
    if not (isinstance(q, dict) and q.get("quant_method")):
        out.pop("quantization_config", None)  # an empty Paddle quant config would make HF try to quantize
    if not out.get("architectures"):
        out["architectures"] = [type(model).__name__]
    out["tie_word_embeddings"] = bool(tied)
    for key in ("dtype", "torch_dtype"):
        out.pop(key, None)  # set by the exporter from the exported dtype
    return out


def generation_config_dict(model) -> Optional[dict]:
    config = getattr(model, "config", None)
    if config is None:
        return None
    out = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(config, k, None) is not None}
    return out or None


def build_model_source(model, config: FullParamConfig, tokenizer: Any = None) -> ModelSource:
    """Everything the export layer needs, from the (unwrapped) model; validates the mapping names."""
    model = unwrap_model(model)
    if not hasattr(model, "sharded_state_dict"):
        raise TypeError(
            f"{type(model).__name__} has no sharded_state_dict(): the exporter needs a paddle.nn.Layer "
            "(Paddle >= 3.3) so that every parameter reports its global shape and offset"
        )
    aoa, pattern = None, None
    tied = weights_tied(model)
    if config.export.format != "paddle_safetensors":
        keys = list(model.sharded_state_dict().keys())
        aoa, pattern = resolve_mapping(config.export.aoa, model, keys, tied=tied)
    spec = config.export.aoa
    return ModelSource(
        sharded_state_dict=model.sharded_state_dict,
        aoa_config=aoa,
        hf_config=hf_config_dict(model, tied) if config.export.format == "hf_safetensors" else None,
        generation_config=generation_config_dict(model) if config.export.format == "hf_safetensors" else None,
        tokenizer=tokenizer,
        framework=framework_of(model),
        check_names=(lambda names: check_destination_names(names, pattern, spec)) if pattern else None,
    )


__all__ = ["build_model_source", "check_destination_names", "unwrap_model"]
