"""Full-parameter Hugging Face snapshots of PaddlePaddle models while they train.

Public surface: :class:`FullParamExportCallback`, :func:`attach`, the config types, :func:`load_config`,
:func:`verify_snapshot`, :func:`convert` (a snapshot of a trainer checkpoint on disk) and the
``paddle-fullparam`` command.
"""
from ._version import __version__
from .config import ConfigError, ExportConfig, FullParamConfig, RetentionConfig, TriggerConfig, load_config
from .convert import convert
from .export.verify import verify_snapshot
from .trainer import FullParamExportCallback, attach

__all__ = [
    "ConfigError", "ExportConfig", "FullParamConfig", "FullParamExportCallback", "RetentionConfig",
    "TriggerConfig", "__version__", "attach", "convert", "load_config", "verify_snapshot",
]
