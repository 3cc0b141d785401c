"""What serving a LoRA run as adapters (``serve.adapter``) must know of the model, at the start of training.

An engine that keeps its base weights and loads each snapshot's PEFT adapter serves the run's model only if the
adapter is all the run changes: :func:`adapter_mode_problem` says why it is not (no LoRA layer; a weight trained
outside the adapter: an embedding, ``trainable_modules``, a bias; a layer merged into its weight, which no longer
holds the base; a layer peft cannot describe). :func:`base_logprobs` is the run's own base model's answer (every
LoRA layer's update off), which the engine's base model must give too.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from . import adapter as peft
from .layers import LoraError, find_lora_layers, is_lora_wrapper

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep until the morning."
"""What the start's base check asks both models to predict (the run's tokenizer's ids of it)."""
IDS = 16
EXAMPLES = 3


def adapter_mode_problem(model, alone: bool = True) -> Optional[str]:
    """Why this rank's part of ``model`` cannot be served as a base model plus the run's adapter; None if it can.
    ``alone``: this part is the whole run's judge of whether it is a LoRA run at all (a pipeline stage other than
    the coordinator's may hold no LoRA layer of a LoRA run)."""
    try:
        layers = find_lora_layers(model)
    except LoraError as e:
        return str(e)
    if not layers and alone:
        return ("the model holds no LoRA layer (not a LoRA run): there is no adapter to load; serve.adapter=false "
                "reloads each snapshot's weights instead")
    merged = [lay.name for lay in layers if lay.state() == "merged"]
    if merged:
        return (f"LoRA layer {merged[0]!r} is merged into its weight (PaddleFormers' merge(), PaddleNLP's "
                "merge_weights): the model no longer holds the base weights the engines serve")
    try:
        peft.adapter_settings(layers)
    except LoraError as e:
        return f"its adapter cannot be written as a PEFT adapter: {e}"
    root = model.model if is_lora_wrapper(model) else model
    trained = sorted(name for name, p in root.named_parameters()
                     if not p.stop_gradient and not name.endswith((".lora_A", ".lora_B")))
    if trained:
        more = f" and {len(trained) - EXAMPLES} more" if len(trained) > EXAMPLES else ""
        return (f"the run trains {len(trained)} weight(s) outside the adapter ({', '.join(trained[:EXAMPLES])}{more}: "
                "trainable_modules, trainable_bias, an embedding or a head left trainable): an adapter cannot carry "
                "them, so each snapshot's weights must be reloaded: set serve.adapter=false")
    return None


def probe_ids(tokenizer, vocab_size: int) -> List[int]:
    """Token ids for the base check: the run's tokenizer's of :data:`TEXT` (ids the engine's tokenizer knows), else
    a fixed spread below the vocabulary (and 256, inside any tokenizer's)."""
    if tokenizer is not None:
        try:
            ids = [int(i) for i in tokenizer(TEXT)["input_ids"]]
            if len(ids) >= 4 and all(0 <= i < vocab_size for i in ids):
                return ids[:IDS]
        except Exception:  # a tokenizer that cannot encode: the fixed ids
            pass
    top = max(8, min(vocab_size, 256))
    return [3 + (37 * i) % (top - 3) for i in range(IDS)]


def base_logprobs(model, ids: Sequence[int]) -> List[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 of ``model`` with every LoRA layer's update off (its scaling 0 for one
    forward pass in eval mode, no gradient; all restored after): what the engine's base model must give."""
    import paddle

    layers = [lay.layer for lay in find_lora_layers(model)]
    scalings = [layer.scaling for layer in layers]
    training = model.training
    try:
        for layer in layers:
            layer.scaling = 0.0
        model.eval()
        with paddle.no_grad():
            out = model(paddle.to_tensor([list(ids)], dtype="int64"))
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
        logits = logits.astype("float32").numpy()[0].astype(np.float64)
    finally:
        for layer, s in zip(layers, scalings):
            layer.scaling = s
        if training:
            model.train()
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return [float(logp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


__all__ = ["adapter_mode_problem", "base_logprobs", "probe_ids"]
