"""The package's shape (docs/architecture.md): modules a reader holds in one sitting, folders that say
what they hold. The direction of the imports is checked by lint-imports (pyproject.toml), in `make docs`."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "paddle_fullparam_callbacks"
MAX_LINES = 450


def test_no_module_is_longer_than_one_sitting():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: split them by concern"


def test_every_folder_says_what_it_holds():
    missing = [str(d.relative_to(PACKAGE)) for d in PACKAGE.rglob("*") if d.is_dir() and d.name != "__pycache__"
               and any(d.glob("*.py")) and not ast.get_docstring(ast.parse((d / "__init__.py").read_text()))]
    assert missing == [], f"package folders without a docstring in __init__.py: {missing}"


def test_the_readme_is_a_newcomers_page():
    """README: the two commands, the one line, the no-code line, what a snapshot is, where the docs are
    (issue 33); everything else is one link away in the docs site."""
    readme = (PACKAGE.parent / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for must in ("## Two commands", "## One line", "## No code", "## Where snapshots go", "## Documentation"):
        assert must in readme, must
