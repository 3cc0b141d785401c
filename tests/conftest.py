"""Shared fixtures. `tests/test_pf_*` need PaddleFormers and run in its environment,
`tests/test_pnlp_*` need PaddleNLP and run in its own (the Makefile picks the files);
everything else runs in both."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hf_python() -> str:
    """Interpreter of the real-client environment (torch + transformers), created if needed."""
    path = os.environ.get("PFC_HF_PYTHON")
    if not path:
        path = subprocess.run(
            ["bash", str(ROOT / "scripts" / "env.sh"), "hf"], check=True, capture_output=True, text=True
        ).stdout.strip()
    return path
