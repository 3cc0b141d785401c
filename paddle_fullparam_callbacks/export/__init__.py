"""Layer 4: one export end to end (``session/``), the streaming writer (``write/``), the commit
protocol (``commit/``) and verification (``verify/``). ``source.py`` is the seam both entry paths
feed: a :class:`ModelSource` from a live model (the trainer) or from files (``convert``)."""
from .session import ExportSession
from .source import ExportError, ModelSource, SnapshotInfo, TensorSource
from .verify import VerifyReport, verify_snapshot

__all__ = ["ExportError", "ExportSession", "ModelSource", "SnapshotInfo", "TensorSource", "VerifyReport", "verify_snapshot"]
