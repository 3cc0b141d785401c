"""Pipeline models (``*ForCausalLMPipe``): the single-process class, names and config a snapshot describes.

A ``*ForCausalLMPipe`` is a Paddle ``PipelineLayer``; its ``sharded_state_dict()`` already names
every tensor as the plain causal-LM class does (global layer indices). What differs is the class
and the config:

- **The class.** PaddleFormers 1.2 ties each pipeline class to its single-process counterpart by
  borrowing that class's name mapping: ``LlamaForCausalLMPipe._gen_inv_aoa_config =
  LlamaForCausalLM._gen_inv_aoa_config`` (a classmethod bound to ``LlamaForCausalLM``; the same
  for Ernie4_5, Phi3, Gemma3, GPT-OSS, Ernie4_5_Moe and the ``*PipeDeprecated`` Qwen classes, whose
  counterpart is ``Qwen2ForCausalLMDeprecated``). :func:`plain_counterpart` reads that binding.
- **The config.** ``GeneralModelForCausalLMPipe.__init__`` (``paddleformers/nn/pp_model.py``)
  rewrites the config object it is given, in place, before building the stages:
  ``initializer_range = sqrt(0.3333 / hidden_size)`` (the value given is lost), ``moe_group_origin``,
  ``moe_group`` (a process group), ``moe_world_size``, ``moe_rank``, ``tensor_model_parallel_size`` and
  ``tensor_parallel_rank`` from the job's topology, and ``disable_ffn_model_parallel`` for MoE groups
  over the model axis; it reads ``pp_seg_method`` (how to cut the model into stages), a key of the
  pipeline class only. :func:`plain_config` turns the single-process description of such a config
  back into the plain class's: each of those keys takes the value a default config of the class
  has (or is left out when the class has none), so that PaddleFormers' single-process
  ``from_pretrained`` and transformers read the config a plain model would have saved.
  ``initializer_range`` keeps the pipeline's value when the plain class's own constructor writes
  one too (PaddleFormers' Ernie 4.5 classes write the same formula); otherwise the value the model
  was configured with was overwritten without a copy, and the config class's default stands for it.
- **The input embedding** of the first stage is ``EmbeddingPipe.embed_tokens``
  (:func:`input_embedding`): ``get_input_embeddings()`` does not reach it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

# written into the config by GeneralModelForCausalLMPipe.__init__ (PaddleFormers 1.2, nn/pp_model.py)
PIPE_WRITTEN_KEYS = (
    "moe_group_origin", "moe_group", "moe_world_size", "moe_rank", "disable_ffn_model_parallel",
    "tensor_model_parallel_size", "tensor_parallel_rank",
)
# read only by the pipeline class: how the layers are cut into stages
PIPE_ONLY_KEYS = ("pp_seg_method",)


def _is_pipeline_layer(cls) -> bool:
    return any(c.__name__ == "PipelineLayer" and c.__module__.startswith("paddle.") for c in cls.__mro__)


def is_pipeline_model(model) -> bool:
    """Whether ``model`` is a Paddle ``PipelineLayer`` (PaddleFormers' ``*ForCausalLMPipe``)."""
    return _is_pipeline_layer(type(model))


def plain_counterpart(model) -> Optional[type]:
    """The single-process class of a pipeline model (``LlamaForCausalLMPipe`` -> ``LlamaForCausalLM``):
    PaddleFormers' pipeline class borrows its name-mapping classmethod from it; PaddleNLP 2.8's
    ``XForCausalLMPipe`` has no such link and is paired with ``X ForCausalLM`` of the same
    ``paddlenlp.transformers`` namespace by its name (PaddleNLP's own convention). None for a
    model that is not a pipeline model, or whose class names no counterpart."""
    cls = type(model)
    if not _is_pipeline_layer(cls):
        return None
    for attr in ("_gen_inv_aoa_config", "_gen_aoa_config"):
        for klass in cls.__mro__:
            owner = getattr(vars(klass).get(attr), "__self__", None)
            if isinstance(owner, type) and not _is_pipeline_layer(owner):
                return owner
    if cls.__module__.startswith("paddlenlp.") and cls.__name__.endswith("Pipe"):
        import importlib

        plain = getattr(importlib.import_module("paddlenlp.transformers"), cls.__name__[: -len("Pipe")], None)
        if isinstance(plain, type) and not _is_pipeline_layer(plain):
            return plain
    return None


def single_named(model) -> Callable[[], dict]:
    """``model.sharded_state_dict`` under the single-process model's names. PaddleFormers' pipeline
    models name their tensors so already; PaddleNLP 2.8's name them by pipeline position
    (``0.embed_tokens.weight``, ``4.weight``), and map those back with their own
    ``_set_pipeline_name_mapping`` (``_pp_to_single_mapping``)."""
    if not (is_pipeline_model(model) and hasattr(model, "_set_pipeline_name_mapping")):
        return model.sharded_state_dict
    import copy

    model._set_pipeline_name_mapping()
    to_single = dict(getattr(model, "_pp_to_single_mapping", None) or {})

    def read() -> dict:
        out = {}
        for key, sw in model.sharded_state_dict().items():
            if key in to_single:
                sw = copy.copy(sw)
                sw.key = to_single[key]
            out[sw.key] = sw
        return out

    return read


def pipe_initializer_range(hidden_size) -> float:
    """The ``initializer_range`` GeneralModelForCausalLMPipe writes over the one it was given."""
    return math.sqrt(0.3333 / hidden_size)


def constructor_assigns(cls, attr: str) -> bool:
    """Whether the constructor of ``cls`` or of one of its bases assigns an attribute ``attr``
    (``config.initializer_range = ...``), read from the constructors' bytecode: PaddleFormers'
    plain Ernie 4.5 classes write the same ``sqrt(0.3333 / hidden_size)`` into their config as the
    pipeline class does, so a plain model of theirs saves that value too."""
    import dis
    import inspect

    for klass in getattr(cls, "__mro__", ()):
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            init = inspect.unwrap(init)  # PaddleFormers wraps model constructors (InitTrackerMeta)
        except ValueError:
            pass
        code = getattr(init, "__code__", None)
        if code is not None and any(i.opname == "STORE_ATTR" and i.argval == attr for i in dis.get_instructions(code)):
            return True
    return False


def input_embedding(model):
    """The input embedding layer of this rank's stage of a pipeline model (PaddleFormers'
    ``EmbeddingPipe.embed_tokens``, the first stage's), None on the other stages or for a model
    that is not a pipeline model. ``get_input_embeddings()`` does not find it: the pipeline
    model has no ``model.embed_tokens`` attribute, only its stages' layers."""
    if not is_pipeline_model(model):
        return None
    for _, layer in model.named_sublayers():
        if any(c.__name__ == "EmbeddingPipe" for c in type(layer).__mro__):
            return getattr(layer, "embed_tokens", None)
    return None


def plain_config(model, described: dict, describe: Callable[[object], dict]) -> dict:
    """``described`` (the single-process description of a pipeline model's config, as
    ``describe(config)`` gives it) as the plain class's config would be described.

    ``describe``: the function that made ``described`` (``model_info.single_process_config``),
    applied to a default config of the plain class to learn the single-process value of every key
    the pipeline class wrote or reads (left out when the default config does not describe it).
    """
    config = model.config
    plain = plain_counterpart(model)
    config_class = getattr(plain, "config_class", None) or type(config)
    if not isinstance(config, config_class):
        config_class = type(config)
    try:
        defaults = describe(config_class())
    except Exception:  # a config class that needs arguments: leave the pipeline keys out
        defaults = {}
    out = dict(described)
    restore = list(PIPE_WRITTEN_KEYS) + list(PIPE_ONLY_KEYS)
    hidden = getattr(config, "hidden_size", None)
    value = out.get("initializer_range")
    if (isinstance(hidden, int) and hidden > 0 and isinstance(value, float) and value == pipe_initializer_range(hidden)
            and not constructor_assigns(plain, "initializer_range")):
        # the pipeline class's value, which the plain class would not have written; the value the
        # model was configured with is gone: the plain class's default stands for it
        restore.append("initializer_range")
    for key in restore:
        if key in defaults:
            out[key] = defaults[key]
        else:
            out.pop(key, None)
    return out


__all__ = ["constructor_assigns", "input_embedding", "is_pipeline_model", "plain_config", "plain_counterpart",
           "pipe_initializer_range", "single_named"]
