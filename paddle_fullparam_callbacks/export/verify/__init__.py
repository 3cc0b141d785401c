"""Checking what was written: one snapshot against its manifest and index (``snapshot``), the paths
it may open (``paths``), an output directory with its pointers (``tree``), the transformers loader's
view (``hf``) and the reports as text or JSON (``render``)."""
from .snapshot import VerifyReport, verify_snapshot

__all__ = ["VerifyReport", "verify_snapshot"]
