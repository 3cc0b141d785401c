"""The model zoo in the PaddleNLP environment: every architecture that builds here, trained by the
real Trainer with the callback, loaded by transformers and by its framework (see tests/zoo/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "zoo"))

from zoo_suite import zoo_tests  # noqa: E402

pytestmark = [pytest.mark.paddlenlp, pytest.mark.slow, pytest.mark.hf_client]
zoo, test_zoo = zoo_tests("paddlenlp")
