"""The processor of a multimodal snapshot: image processor config and chat template beside the tokenizer.

A multimodal job gives PaddleFormers' Trainer a ``tokenizer`` and its processor as
``processing_class`` (PaddleFormers' own SFT workflow does), but the Trainer hands callbacks the
tokenizer only. ``attach(trainer)`` reads ``trainer.processing_class``; with the processor known, the
snapshot gets what its ``save_pretrained`` writes (``preprocessor_config.json``,
``chat_template.jinja``, ``video_preprocessor_config.json``, the tokenizer files). A multimodal model
exported without one gets a warning at start saying how to give it.
"""
from __future__ import annotations

from typing import Any

NO_PROCESSOR = (
    "the model is multimodal (its config has a vision_config) but no processor is known: snapshots will hold "
    "no image processor config or chat template, so AutoProcessor / AutoImageProcessor cannot load them. "
    "PaddleFormers' Trainer hands callbacks its tokenizer, not its processing_class: register the callback with "
    "attach(trainer) (it reads trainer.processing_class), or set export.tokenizer to the processor's directory")


def is_processor(obj: Any) -> bool:
    """A multimodal processor (or an image / video processor alone), not a plain tokenizer."""
    return obj is not None and any(getattr(obj, a, None) is not None
                                   for a in ("image_processor", "video_processor", "feature_extractor")) \
        or type(obj).__name__.endswith(("ImageProcessor", "VideoProcessor"))


def is_multimodal(model) -> bool:
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


class _TokenizerAndProcessor:
    """A tokenizer and an image processor that knows no tokenizer, written as one (both save_pretrained)."""

    def __init__(self, tokenizer, processor):
        self.tokenizer, self.processor = tokenizer, processor

    def save_pretrained(self, directory: str) -> None:
        self.tokenizer.save_pretrained(directory)
        self.processor.save_pretrained(directory)


def with_processor(tokenizer: Any, processing_class: Any) -> Any:
    """What a snapshot's tokenizer files come from: the processor when it carries the tokenizer (its
    ``save_pretrained`` writes both), both when it does not, else the tokenizer alone."""
    if not is_processor(processing_class) or processing_class is tokenizer:
        return tokenizer
    if tokenizer is None or getattr(processing_class, "tokenizer", None) is not None:
        return processing_class
    return _TokenizerAndProcessor(tokenizer, processing_class)


def missing_processor(model, tokenizer: Any) -> bool:
    """A multimodal model whose snapshots would carry no processor files."""
    return is_multimodal(model) and not isinstance(tokenizer, _TokenizerAndProcessor) and not is_processor(tokenizer)
