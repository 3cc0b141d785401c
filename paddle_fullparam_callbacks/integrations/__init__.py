"""Layer 5: the trainer callback, model adapters and name-mapping presets."""
from .callback import FullParamExportCallback
from .mappings import PRESETS

__all__ = ["FullParamExportCallback", "PRESETS"]
