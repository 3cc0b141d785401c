"""Checking what was written: one snapshot against its manifest and index (``snapshot``), the paths
it may open (``paths``), an output directory with its pointers (``tree``), the transformers loader's
view (``hf``), a snapshot's companion such as its PEFT adapter (``companion``) and the reports as text or JSON
(``render``)."""
from .companion import verify_companion
from .snapshot import VerifyReport, verify_snapshot

__all__ = ["VerifyReport", "verify_companion", "verify_snapshot"]
