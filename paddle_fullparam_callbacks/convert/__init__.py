"""The offline path: ``paddle-fullparam convert`` turns a trainer checkpoint on disk into the
snapshot the callback would have written. Checkpoint readers (``checkpoints/``: files indexed,
never loaded whole), the preparation (``prepare``: model, checks, the file tensor source), the
entry point (``convert``) and its worker processes (``workers``). Feeds the export through
:class:`~..export.source.ModelSource` with ``tensors`` set."""
from .checkpoints import CheckpointError
from .convert import convert
from .prepare import ConvertError

__all__ = ["CheckpointError", "ConvertError", "convert"]
