"""The export's public names, where they have always been imported from.

The flow itself is split by concern: ``source.py`` (what goes in and out), ``planning.py`` (the
plan), ``streaming.py`` (where full tensors come from), ``finishing.py`` (status exchange and
commit), ``session.py`` (the session that ties them together across a job's exports).
"""
from .finishing import new_run_id
from .session import ExportSession
from .source import ExportError, ModelSource, SnapshotInfo, TensorSource

__all__ = ["ExportError", "ExportSession", "ModelSource", "SnapshotInfo", "TensorSource", "new_run_id"]
