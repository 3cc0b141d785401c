"""The model zoo in the PaddleFormers environment: every architecture that builds here, trained by
the real Trainer with the callback, loaded by transformers (see tests/zoo/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "zoo"))

from case import all_cases  # noqa: E402
from zoo_suite import check_case, run_suite  # noqa: E402

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow, pytest.mark.hf_client]
CASES = all_cases("paddleformers")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, hf_python):
    return run_suite("paddleformers", tmp_path_factory.mktemp("zoo"), hf_python)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_zoo(zoo, case):
    results, hf = zoo
    check_case(case, results[case.id], hf[case.id])
