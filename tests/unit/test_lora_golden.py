"""The LoRA merge's bytes are today's: the digests of ``tests/_lora_golden.py``'s corpus (every layout and block
of the lazy-merge test, inputs reaching every branch of the product's rule) equal those recorded before issue 42
changed how the product is computed (``tests/unit/data/lora_golden.json``), whatever OpenBLAS's thread count."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _lora_golden  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "data" / "lora_golden.json"


@pytest.fixture(scope="module")
def computed():
    return _lora_golden.corpus()


def test_the_corpus_covers_every_lazy_merge_layout_and_block(computed):
    want = json.loads(GOLDEN.read_text())
    assert set(computed) == set(want)
    for m, n, r in _lora_golden.LAZY_SHAPES:
        for dtype in ("float32", "bfloat16"):
            for layout in ("paddle", "hf"):
                for width in _lora_golden.WIDTHS:
                    assert f"lazy_rows/lazy_{m}x{n}x{r}_{dtype}/{layout}/{width}" in want


def test_every_digest_is_the_recorded_one(computed):
    want = json.loads(GOLDEN.read_text())
    differ = sorted(k for k in want if computed.get(k) != want[k])
    assert not differ, differ
