"""The engines' protocols, one module each (``base.py``: the client, the error, the contract): ``vllm.py``.
A second engine (SGLang's ``/update_weights_from_disk``) is one more module here and one more name in
``config/serving.ENGINES``, on the day a test can run it. Standard library only."""
from __future__ import annotations

from .base import Adapter, Engine, EngineError, Probe, Refusal, Swap, Target
from .vllm import VLLMEngine

ENGINES = {VLLMEngine.NAME: VLLMEngine}


def engine_class(name: str):
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None


__all__ = ["Adapter", "ENGINES", "Engine", "EngineError", "Probe", "Refusal", "Swap", "Target", "VLLMEngine",
           "engine_class"]
