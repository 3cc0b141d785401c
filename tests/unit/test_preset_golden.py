"""Every mapping preset gives what it gave when the golden file was recorded: the same destination
tensors filled from the same source elements (names, shapes, dtypes, transposes, casts), the same
config.json keys and warnings, the same refusals, word for word (see ``preset_golden.py``).

The source tensors of the zoo's models are recorded in ``data/preset_sources.json``, so this needs
Paddle's AOAEngine but neither PaddleNLP nor PaddleFormers; it runs in both environments.

After a deliberate change of a preset's result, re-record: ``python tests/unit/preset_golden.py golden``
(and say why in the commit).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("paddle.distributed.flex_checkpoint.aoa.aoa_engine")

import preset_golden as pg  # noqa: E402  (tests/unit)

SOURCES = json.loads(pg.SOURCES.read_text())
GOLDEN = json.loads(pg.GOLDEN.read_text())
CASES = dict(pg.variants(SOURCES))


def test_every_recorded_result_is_checked():
    assert sorted([*CASES, pg.REGISTRY]) == sorted(GOLDEN)
    # every preset, with a zoo model of its own
    assert {c["preset"] for c in CASES.values()} == set(GOLDEN[pg.REGISTRY]["presets"])


def test_the_registry_is_unchanged():
    assert pg.registry() == GOLDEN[pg.REGISTRY]


@pytest.mark.parametrize("vid", sorted(CASES))
def test_preset_result_is_the_golden_one(vid):
    got, want = pg.observe(CASES[vid]), GOLDEN[vid]
    # destination by destination first, so that a failure names the tensor that moved
    gd, wd = got["destinations"], want["destinations"]
    assert sorted(gd) == sorted(wd), "destination names (or the error) differ"
    for name in wd:
        assert gd[name] == wd[name], f"{name}: its elements come from elsewhere now (or its shape/dtype changed)"
    assert got == want
