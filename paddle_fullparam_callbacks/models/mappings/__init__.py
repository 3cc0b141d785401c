"""Name mappings from Paddle models to Hugging Face architectures.

PaddleFormers models bring their own (``_gen_inv_aoa_config``); where a framework has none or a
wrong one, a :class:`~.base.Preset` of this package takes its place, picked by class.
"""
from . import paddleformers  # noqa: F401  (registers its presets)
from . import paddlenlp_glm_qwen, paddlenlp_llama  # noqa: F401
from . import paddlenlp_bloom_falcon, paddlenlp_gpt, paddlenlp_opt_ctrl  # noqa: F401
from .base import AUTO, PRESETS, MappingContext, Preset
from .resolve import ResolvedMapping, check_destination_names, resolve_mapping

__all__ = ["AUTO", "PRESETS", "MappingContext", "Preset", "ResolvedMapping", "check_destination_names", "resolve_mapping"]
