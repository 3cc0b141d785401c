"""The test harness's workaround for Paddle 3.3.1's TCPStore abort at start (``uv__finish_close``): a launch that
dies of it is retried once in a fresh log folder; any other failure is returned as it is, never retried.

A stand-in interpreter plays ``python -m paddle.distributed.launch``: it writes a rank log into ``--log_dir`` and
exits as the script it is given says, counting its own calls in a file."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
import harness  # noqa: E402

FAKE_LAUNCHER = """#!/bin/sh
# argv: -m paddle.distributed.launch --nproc_per_node N --log_dir DIR SCRIPT
calls="$(dirname "$0")/calls"
echo x >> "$calls"
n=$(wc -l < "$calls")
log_dir="$6"; mode="$(cat "$7")"
mkdir -p "$log_dir"
if [ "$mode" = "abort-once" ] && [ "$n" -eq 1 ] || [ "$mode" = "abort-always" ]; then
  echo "python: core.c:314: uv__finish_close: Assertion failed." > "$log_dir/workerlog.0"
  exit 250
fi
if [ "$mode" = "fail" ]; then echo "Traceback: ValueError" > "$log_dir/workerlog.0"; exit 1; fi
echo "PROBE {\\"attempt\\": $n}" > "$log_dir/workerlog.0"
"""


def _launch(tmp_path: Path, mode: str) -> tuple:
    fake = tmp_path / "python"
    fake.write_text(FAKE_LAUNCHER)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "mode"
    script.write_text(mode)
    res = harness.run_launch(script, nproc=1, log_dir=tmp_path / "log", timeout=30, python=str(fake))
    calls = len((tmp_path / "calls").read_text().splitlines())
    return res, calls


def test_a_store_abort_is_retried_once_in_a_fresh_log_folder(tmp_path):
    res, calls = _launch(tmp_path, "abort-once")
    assert (res.rc, calls) == (0, 2), res.describe()
    assert res.log_dir == str(tmp_path / "log") + "-retry"
    assert res.tagged("PROBE") == [(0, {"attempt": 2})]
    first = (tmp_path / "log" / "workerlog.0").read_text()
    assert harness.store_aborted(harness.LaunchResult(250, False, 0.0, "", "", {0: first}))


def test_a_second_store_abort_is_returned_not_retried_again(tmp_path):
    res, calls = _launch(tmp_path, "abort-always")
    assert (res.rc, calls) == (250, 2)
    assert harness.store_aborted(res)


def test_any_other_failure_is_returned_as_it_is(tmp_path):
    res, calls = _launch(tmp_path, "fail")
    assert (res.rc, calls) == (1, 1)
    assert not harness.store_aborted(res) and "ValueError" in res.logs[0]
    assert os.path.isdir(tmp_path / "log") and not os.path.exists(str(tmp_path / "log") + "-retry")
