"""Shared fixtures. `tests/test_pf_*` need PaddleFormers and run in its environment,
`tests/test_pnlp_*` need PaddleNLP and run in its own (the Makefile picks the files);
everything else runs in both."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the project is not installed into the shared environments (two clones would test each other's
# code): every process a test starts (CLI runs, launched ranks, the zoo's halves) imports this
# checkout, also when pytest was started without PYTHONPATH
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and Path(p).resolve() != ROOT]])


@pytest.fixture(scope="session")
def hf_python() -> str:
    """Interpreter of the real-client environment (torch + transformers), created if needed."""
    path = os.environ.get("PFC_HF_PYTHON")
    if not path:
        path = subprocess.run(
            ["bash", str(ROOT / "scripts" / "env.sh"), "hf"], check=True, capture_output=True, text=True
        ).stdout.strip()
    return path


@pytest.fixture(scope="session")
def fake_device() -> Path:
    """Folder of the fake accelerator plugin (built if needed, see `tests/_fake_device.py`). A build
    that fails makes the test fail, never skip."""
    from _fake_device import FakeDeviceError, build

    try:
        return build()
    except FakeDeviceError as e:
        pytest.fail(f"the fake accelerator could not be built:\n{e}", pytrace=False)
