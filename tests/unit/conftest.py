"""Unit-test fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture()
def isolated_recipes_dir(tmp_path, monkeypatch):
    """Bundled recipes come from an empty folder, so a test does not depend on the repository's."""
    d = tmp_path / "bundled"
    d.mkdir()
    monkeypatch.setenv("PFC_RECIPES_DIR", str(d))
    return d
