"""What the exporter needs from a live model: its sharded state dict, mapping, HF config."""
from __future__ import annotations

import logging
import re
from typing import Any, Optional, Tuple

from ..config.schema import FullParamConfig
from ..assemble.mapping import MappingError
from ..export.source import ModelSource
from . import tokenizer as tokenizers
from .fleet import fleet_class, model_config
from .mapping_check import check_layout
from .hf_config import PARALLEL_KEY as _PARALLEL_KEY  # noqa: F401  (convert/prepare.py reads it here)
from .hf_config import config_dict as _config_dict
from .hf_config import check_loadable, describe
from .lora import attach_to_source as attach_lora, base_model as lora_base, lora_export
from .mappings import check_destination_names, resolve_mapping
from .mappings.fp8 import fp8_declaration

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


def _layer_weight(layer):
    """An embedding or LM head layer's matrix (PaddleNLP's Bloom/OPT heads call it ``decoder_weight``)."""
    for attr in ("weight", "decoder_weight"):
        w = getattr(layer, attr, None)
        if w is not None:
            return w
    return None


def _embedding(model, which: str):
    try:
        layer = getattr(model, f"get_{which}_embeddings")()
    except (AttributeError, NotImplementedError):
        return None
    return _layer_weight(layer) if layer is not None else None


def _key_of(sharded_state_dict, tensor) -> Optional[str]:
    for key, sw in sharded_state_dict.items():
        if sw.local_tensor is tensor:
            return key
    return None


_LM_HEAD = re.compile(r"(.*\.)?lm_head\.(decoder_)?weight$")


def output_embedding(model, sharded_state_dict) -> Tuple[Optional[str], bool]:
    """(the LM head's key in the sharded state dict, whether it *is* the input embedding).

    Decided by identity, never by the config's claim alone: PaddleNLP 2.8's Llama accepts
    ``tie_word_embeddings=True`` but keeps a separate head, and its OPT defaults to that claim
    while its head (``lm_head.decoder_weight``) is always its own parameter.
    """
    config = model_config(model)
    claimed = bool(getattr(config, "tie_word_embeddings", False))
    inp, out = _embedding(model, "input"), _embedding(model, "output")
    if out is None:  # no accessor: the matrix of the model's lm_head, if it has one
        heads = (sw.local_tensor for k, sw in sharded_state_dict.items() if _LM_HEAD.match(k))
        out = next(heads, None)
    if inp is None or out is None:
        # nothing to compare: the claim stands (a preset refuses a claim its architecture contradicts)
        return None, claimed
    tied = out is inp
    if claimed and not tied:
        logger.warning(
            "%s: config says tie_word_embeddings=True but the LM head has its own weight; "
            "exporting it and writing tie_word_embeddings=false", type(model).__name__,
        )
    return _key_of(sharded_state_dict, out), tied


def weights_tied(model) -> bool:
    """Whether the output embedding *is* the input embedding (see :func:`output_embedding`)."""
    return output_embedding(model, model.sharded_state_dict())[1]


def parallel_degrees(config) -> dict:
    """The parallel-degree keys of the model config as the job built it (e.g. tensor_parallel_degree)."""
    if config is None:
        return {}
    return {k: v for k, v in _config_dict(config).items() if _PARALLEL_KEY.match(k) and isinstance(v, int)
            and not isinstance(v, bool)}


def single_process_config(config, tied: Optional[bool] = None) -> dict:
    """The model config as the framework's single-process ``save_pretrained`` would describe it,
    nested sub-configs included, by the one rule of ``hf_config.py``.

    Every architecture key stays explicit (transformers would otherwise fill in its own defaults,
    which need not be the framework's); parallel-degree keys take their single-process value; the
    framework's generic keys left at their defaults are dropped (they are training machinery,
    e.g. recompute and fusion switches, that neither transformers nor a reload needs spelled out).
    """
    return describe(config, tied)


def hf_config_dict(model, tied: bool, preset=None) -> Optional[dict]:
    """config.json content for transformers: the single-process model config, HF's required keys set.

    For a pipeline model (PaddleFormers' ``*ForCausalLMPipe``) it is the config of its plain
    causal-LM class (``pipe.py``): that class's name and initializer values, no
    pipeline- or parallel-only keys.

    ``preset``: a mapping preset of this package; its ``hf_config`` translates the keys and it
    names the Hugging Face architecture (a framework's own mapping keeps the framework's names).
    """
    config = model_config(model)
    if config is None:
        return None
    from .pipe import is_pipeline_model, plain_config

    if preset is None:
        check_loadable(config)
    out = single_process_config(config, tied)
    if is_pipeline_model(model):
        # a *ForCausalLMPipe rewrote its config in place (see pipe.py): the snapshot
        # describes the plain causal-LM class, with the config that class would have
        out = plain_config(model, out, single_process_config)
    if preset is not None:
        if preset.hf_config is not None:
            out = preset.hf_config(out)
        out["architectures"] = [preset.hf_architecture]
        out["model_type"] = preset.hf_model_type
    else:
        out["architectures"] = [plain_class_name(model)]
    out["tie_word_embeddings"] = bool(tied)
    return out


def plain_class_name(model) -> str:
    """The single-process causal-LM class a snapshot describes, by its Hugging Face name:
    ``LlamaForCausalLMPipe`` -> ``LlamaForCausalLM`` (the class the pipeline class borrows its name
    mapping from, see ``pipe.py``), PaddleFormers' ``Qwen2ForCausalLMPipeDeprecated`` ->
    ``Qwen2ForCausalLMDeprecated`` -> ``Qwen2ForCausalLM`` (its pure-Paddle implementation of that class)."""
    from .pipe import plain_counterpart

    plain = fleet_class(model) or plain_counterpart(model)
    name = plain.__name__ if plain is not None else type(model).__name__
    for suffix in ("Deprecated", "Pipe"):
        name = name[: -len(suffix)] if name.endswith(suffix) else name
    return name


# generation settings of the frameworks that transformers' GenerationConfig does not have, or that
# describe the training run rather than the model (the Trainer turns the cache off while it trains)
_GENERATION_DROP = ("use_cache", "decode_strategy", "use_fast", "use_fp16_decoding", "trunc_input")


def generation_config_dict(model) -> Optional[dict]:
    """generation_config.json: the token ids of the model's config, and what the model's own
    ``generation_config`` sets beyond the defaults (PaddleNLP models carry one; a PaddleFormers
    model built from a config has none)."""
    config = model_config(model)
    out = {} if config is None else {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                     if getattr(config, k, None) is not None}
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            own = gen.to_diff_dict() if hasattr(gen, "to_diff_dict") else gen.to_dict()
        except Exception:  # a framework's object we cannot read: the ids still go out
            own = {}
        out.update({k: v for k, v in own.items()
                    if not k.startswith("_") and k not in _GENERATION_DROP and v is not None})
    return out or None


def embedding_padding_row(model, sharded_state_dict) -> Optional[Tuple[str, int]]:
    """(source key, row) when the input embedding has a Paddle ``padding_idx``: Paddle returns
    zeros for that id whatever the row holds; torch returns the row."""
    from .pipe import input_embedding, is_pipeline_model

    try:
        layer = input_embedding(model) if is_pipeline_model(model) else model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    pad = getattr(layer, "_padding_idx", None)
    weight = _layer_weight(layer) if layer is not None else None
    key = _key_of(sharded_state_dict, weight) if weight is not None else None
    if pad is None or isinstance(pad, bool) or key is None:
        return None
    sw = sharded_state_dict[key]
    if tuple(sw.global_shape) != tuple(sw.local_shape):
        return None  # sharded over ranks: Paddle's parallel embeddings have no padding index
    return key, int(pad) if pad >= 0 else int(weight.shape[0]) + int(pad)


def _check_mapping(dmap, resolved, spec, tied: bool, lm_head_source: Optional[str], hf_config: Optional[dict]) -> None:
    """Refuse mappings that would make transformers fill in random weights, or load wrong ones, before any byte."""
    check_destination_names(dmap.names, resolved.destination_pattern, spec)
    head = resolved.preset.lm_head if resolved.preset is not None else "lm_head.weight"
    if resolved.vouched:
        # a framework's mapping or a preset names every tensor it exports (PaddleFormers' list even
        # the identity renames); a source no statement touched keeps its Paddle name, which
        # transformers does not know (PaddleFormers 1.2's Qwen3-Next passes eleven fused tensors
        # through). Only the LM head already under its HF name may pass (tied, transformers ties
        # it to the embedding it equals).
        allowed = {head} if head else set()
        stray = sorted(n for n in dmap.passthrough if n not in allowed)
    else:
        # a mapping of the user's may leave names alone, but not a family it converts elsewhere
        converted = {_family(n) for n in dmap.transformed}
        stray = sorted(n for n in dmap.passthrough if _family(n) in converted)
    if stray:
        more = f" and {len(stray) - 3} more" if len(stray) > 3 else ""
        raise MappingError(
            f"the name mapping ({resolved.source}) exports {stray[:3]}{more} under Paddle names no statement maps: "
            "transformers would not find these weights and would initialise them at random. "
            "Give a complete mapping with export.aoa (a preset, a file or a list of statements); a tensor meant to "
            "keep its name can be renamed to itself ('a -> a')"
        )
    if not tied and lm_head_source is not None and head and head not in dmap.spec_by_name:
        raise MappingError(
            f"the model has its own output embedding ({lm_head_source}) but the name mapping ({resolved.source}) "
            f"exports no {head!r}: transformers would initialise the LM head at random. Give a mapping that "
            "exports it with export.aoa"
        )
    if hf_config is not None:
        check_layout(dmap, resolved.aoa_config, hf_config, resolved.source)


def _family(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


def build_model_source(model, config: FullParamConfig, tokenizer: Any = None,
                       warn_no_tokenizer: bool = False) -> ModelSource:
    """Everything the export layer needs, from the (unwrapped) model; validates the mapping names.

    ``tokenizer``: the trainer's (or the checkpoint's saved files); ``export.tokenizer``'s files win
    (``models/tokenizer.py``). ``warn_no_tokenizer``: say once that snapshots will have none (the
    coordinator, at start).

    The mapping is resolved here from this rank's tensors (so that a bad ``export.aoa`` fails at
    once), and again when the export plans, from every mesh rank's tensors (a pipeline stage holds
    only its own layers; a preset writes statements for the whole model).
    """
    from .pipe import single_named
    from .shard_fixes import fixed_sharded_state_dict  # tensor-parallel entries that contradict their layer

    model = unwrap_model(model)
    wrapper, model = model, lora_base(model)  # LoRA (issue 20): a LoRAModel exports its base model's names
    if not hasattr(model, "sharded_state_dict"):
        raise TypeError(
            f"{type(model).__name__} has no sharded_state_dict(): the exporter needs a paddle.nn.Layer "
            "(Paddle >= 3.3) so that every parameter reports its global shape and offset"
        )
    read = fixed_sharded_state_dict(model, single_named(model))
    lora = lora_export(wrapper, read, config, framework_of(model))  # None without LoRA layers
    read = lora.main_state_dict if lora is not None else read  # the mapping sees base keys only
    hf = config.export.format == "hf_safetensors"
    sd = read()
    lm_head, tied = output_embedding(model, sd)
    resolved, mapping_for, check, notes, padding, hf_config = None, None, None, {}, {}, None
    if config.export.format != "paddle_safetensors":
        spec = config.export.aoa
        own_config = model_config(model)
        kwargs = dict(tied=tied, config=single_process_config(own_config) if own_config is not None else None,
                      parallel=parallel_degrees(own_config))
        resolved = resolve_mapping(spec, model, {k: tuple(sw.global_shape) for k, sw in sd.items()}, **kwargs)
        hf_config = hf_config_dict(model, tied, resolved.preset) if hf else None
        state = {"resolved": resolved}

        def mapping_for(shapes):  # every mesh rank's tensors: the mapping of the whole model
            whole = resolve_mapping(spec, model, shapes, **kwargs)
            state["resolved"] = whole
            notes["mapping"] = whole.source
            notes.pop("mapping_repairs", None)
            if whole.repairs:
                notes["mapping_repairs"] = whole.repairs
                if state.get("logged") != whole.repairs:  # the repairs of the whole model, once
                    state["logged"] = whole.repairs
                    for r in whole.repairs:
                        logger.warning("%s: %s", whole.source, r)
            return whole.aoa_config

        notes["mapping"] = resolved.source
        check = lambda dmap: _check_mapping(dmap, state["resolved"], spec, tied, lm_head, hf_config)  # noqa: E731
        pad = embedding_padding_row(model, sd) if hf else None
        if pad is not None:
            key, row = pad
            if tied:
                # the row is also an output row: zeroing it would change the logits of token `row`
                notes["padding_row_kept"] = {key: row}
                logger.warning(
                    "%s: the input embedding has padding_idx=%d (Paddle returns zeros for that id) and is tied to "
                    "the LM head; the snapshot keeps the stored row, so transformers embeds id %d as that row",
                    type(model).__name__, row, row)
            else:
                padding[key] = row
    quantization = None
    if config.export.quantization != "none":  # the architecture's declaration, or a ConfigError naming it
        archs = (hf_config or {}).get("architectures") or [""]
        quantization = fp8_declaration(archs[0])
    source = ModelSource(
        sharded_state_dict=read,
        aoa_config=resolved.aoa_config if resolved else None,
        mapping_for=mapping_for,
        hf_config=hf_config if resolved else (hf_config_dict(model, tied) if hf else None),
        generation_config=generation_config_dict(model) if hf else None,
        tokenizer=tokenizers.choose(config.export.tokenizer, tokenizer, warn_no_tokenizer),
        framework=framework_of(model),
        check_mapping=check,
        padding_rows=padding,
        notes=notes,
        quantization=quantization,
    )
    if lora is not None:
        attach_lora(lora, source, config)  # merge transforms, PEFT adapter, manifest notes
    return source


__all__ = ["build_model_source", "hf_config_dict", "single_process_config", "unwrap_model"]
