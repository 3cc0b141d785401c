"""Models built through paddlefleet (PaddleFormers 1.2 with paddlefleet installed, as on GPU clusters).

There, ``Qwen2ForCausalLM(config)`` (and Qwen3, the MoE classes, GLM4-MoE, DeepSeek, Qwen3-VL, ...)
returns no ``Qwen2ForCausalLM`` but a paddlefleet ``GPTModel``: its own parameter names, its own
``config`` (paddlefleet's), and, set on the instance by the class's ``__new__``, the class's name
mappings (``_gen_inv_aoa_config`` / ``_gen_aoa_config``, bound to the PaddleFormers class) and the
PaddleFormers config (``config_to_save``), which PaddleFormers' own ``save_pretrained`` writes. The
package reads them the same way: the mapping from the instance, ``config.json`` from
``config_to_save``, the architecture from the class the mappings are bound to. (paddlefleet is
not on PyPI; the tests use an object of this shape.)
"""
from __future__ import annotations

from typing import Any, Optional

MAPPINGS = ("_gen_inv_aoa_config", "_gen_aoa_config")


def instance_attribute(model, name: str) -> Any:
    """An attribute set on the instance itself (not its class, not a ``__getattr__`` fallback)."""
    return getattr(model, "__dict__", {}).get(name)


def fleet_class(model) -> Optional[type]:
    """The PaddleFormers class a paddlefleet-built model stands for, or None for any other model."""
    for name in MAPPINGS:
        owner = getattr(instance_attribute(model, name), "__self__", None)
        if isinstance(owner, type):
            return owner
    return None


def model_config(model):
    """The model's config as its framework describes it: ``config_to_save`` of a paddlefleet build."""
    saved = instance_attribute(model, "config_to_save")
    return saved if saved is not None else getattr(model, "config", None)
