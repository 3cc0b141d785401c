"""Layer 4: writers, exporters, the commit protocol, manifest and verification."""
from .session import ExportSession
from .source import ExportError, ModelSource, SnapshotInfo
from .verify import VerifyReport, verify_snapshot

__all__ = ["ExportError", "ExportSession", "ModelSource", "SnapshotInfo", "VerifyReport", "verify_snapshot"]
