"""``attach(trainer, recipe_or_config)``: the callback plus the checkpoint hook, in one call.

With ``checkpoint_hook.enabled``, the trainer's own ``_save_checkpoint`` is wrapped so that each
``checkpoint-N/`` also holds the HF snapshot of step N in ``checkpoint_hook.subdir`` (through the
same atomic commit); the trainer's rotation (``save_total_limit``) then removes both together,
and resuming from ``checkpoint-N`` reads the trainer's files as before.
"""
from __future__ import annotations

import functools
import logging
import warnings
from typing import Iterable

from .callback import FullParamExportCallback

logger = logging.getLogger("paddle_fullparam_callbacks")


def attach(trainer, config=None, overrides: Iterable[str] = (), **kwargs) -> FullParamExportCallback:
    """Register a :class:`FullParamExportCallback` on ``trainer`` (PaddleFormers or PaddleNLP).

    Example::

        cb = attach(trainer, "checkpoint_hook", overrides=["export.dtype=bfloat16"])
        trainer.train()
    """
    cb = config if isinstance(config, FullParamExportCallback) else FullParamExportCallback(config, overrides=overrides, **kwargs)
    cb.trainer = trainer
    cb.processing_class = getattr(trainer, "processing_class", None)  # PaddleFormers hands callbacks the tokenizer only
    trainer.add_callback(cb)
    if cb.config.checkpoint_hook.enabled:
        _hook_checkpoints(trainer, cb)
    save_hf = getattr(getattr(trainer, "args", None), "save_hf_steps", -1)
    if isinstance(save_hf, int) and save_hf > 0 and cb.config.enabled:
        warnings.warn(
            f"PaddleFormers' own save_hf_steps={save_hf} is on as well: two HF writers will export the same "
            "steps; set save_hf_steps=-1 or disable this callback", UserWarning, stacklevel=2,
        )
    return cb


def _hook_checkpoints(trainer, cb: FullParamExportCallback) -> None:
    original = getattr(trainer, "_save_checkpoint", None)
    if original is None:
        raise TypeError(f"{type(trainer).__name__} has no _save_checkpoint(): the checkpoint hook needs a "
                        "PaddleFormers or PaddleNLP Trainer")
    if getattr(original, "_pfc_hooked", False):
        return

    @functools.wraps(original)
    def save_checkpoint(model, *args, **kwargs):
        result = original(model, *args, **kwargs)
        cb.export_into_checkpoint(trainer.args, trainer.state, model,
                                  getattr(trainer, "tokenizer", None) or getattr(trainer, "processing_class", None))
        return result

    save_checkpoint._pfc_hooked = True
    save_checkpoint._pfc_callback = cb  # whose hook this is (autoattach removes its own, never a user's)
    trainer._save_checkpoint = save_checkpoint
    cb._hooked = True
