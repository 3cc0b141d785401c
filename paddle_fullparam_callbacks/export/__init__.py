"""Layer 4: writers, exporters, the commit protocol, manifest and verification."""
from .runner import ExportError, ExportSession, ModelSource, SnapshotInfo
from .verify import VerifyReport, verify_snapshot

__all__ = ["ExportError", "ExportSession", "ModelSource", "SnapshotInfo", "VerifyReport", "verify_snapshot"]
