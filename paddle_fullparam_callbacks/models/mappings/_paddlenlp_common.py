"""How the PaddleNLP 2.8 presets of this package are registered."""
from __future__ import annotations

from typing import Callable, List, Optional

from .base import MappingContext, Preset, register
from .builders import cannot_export


def paddlenlp_preset(name: str, cls: str, statements: Callable[[MappingContext], list], hf_config: Callable[[dict], dict],
                     problems: Optional[Callable[[dict], List[str]]] = None, **fields) -> Preset:
    """Register preset ``name`` for PaddleNLP's class ``cls``. ``problems(config)``: what the Hugging
    Face architecture cannot express, refused (all at once, naming the config keys) before the
    statements or the config.json are made."""

    def check(config: dict) -> None:
        if problems is not None:
            cannot_export("PaddleNLP", cls, problems(config))

    def checked_statements(ctx: MappingContext) -> list:
        check(ctx.config)
        return statements(ctx)

    def checked_config(config: dict) -> dict:
        check(config)
        return hf_config(config)

    return register(Preset(name=name, framework="paddlenlp", classes=(cls,), statements=checked_statements,
                           hf_config=checked_config, **fields))
