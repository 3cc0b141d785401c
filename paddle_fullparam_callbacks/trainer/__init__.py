"""The live path: :class:`FullParamExportCallback`, :func:`attach` and the checkpoint hook, the
topology of the running job (``topology``) and the trainer's own paths (``paths``). Feeds the
export through :class:`~..export.source.ModelSource` built by ``models``."""
from .attach import attach
from .callback import FullParamExportCallback

__all__ = ["FullParamExportCallback", "attach"]
