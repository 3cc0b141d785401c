"""The order files reach the suite's workers (tests/_schedule.py): longest first, each file's tests together and in
their order, unlisted files after the listed ones in their own order."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _schedule import SECONDS, file_of, longest_first  # noqa: E402


def test_long_files_first_each_files_tests_together_and_in_order():
    ids = ["tests/test_a.py::t1", "tests/test_pf_export.py::x", "tests/test_a.py::t2",
           "tests/test_pf_benches.py::b1", "tests/test_pf_export.py::y", "tests/test_pf_benches.py::b2",
           "tests/unit/test_b.py::u"]
    order = [ids[i] for i in longest_first(ids)]
    assert order == ["tests/test_pf_benches.py::b1", "tests/test_pf_benches.py::b2", "tests/test_pf_export.py::x",
                     "tests/test_pf_export.py::y", "tests/test_a.py::t1", "tests/test_a.py::t2",
                     "tests/unit/test_b.py::u"]


def test_every_listed_file_exists():
    root = Path(__file__).resolve().parents[2]
    assert [f for f in SECONDS if not (root / f).is_file()] == []


def test_this_session_runs_long_files_first(request):
    files = []
    for item in request.session.items:
        f = file_of(item.nodeid)
        if not files or files[-1] != f:
            files.append(f)
    weights = [SECONDS.get(f, 0) for f in files]
    assert weights == sorted(weights, reverse=True)
    assert len(files) == len(set(files))  # each file's tests together
