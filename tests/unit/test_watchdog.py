"""export.timeout_s: the watchdog ends a rank stuck in a collective and names the peer holding it up."""
from __future__ import annotations

import json
import re
import threading
import time

from paddle_fullparam_callbacks.export.commit.watchdog import EXIT_CODE, Watchdog


def _watchdog(tmp_path, rank=0, timeout=0.3):
    fired = threading.Event()
    codes = []

    def exit_fn(code):
        codes.append(code)
        fired.set()

    wd = Watchdog(timeout, rank, [0, 1, 2], tmp_path, exit_fn=exit_fn)
    return wd, fired, codes


def test_a_rank_stuck_in_a_collective_is_ended_naming_the_peer_that_stopped(tmp_path, caplog):
    wd, fired, codes = _watchdog(tmp_path)
    now = time.time()
    # rank 1 is alive and waiting too; rank 2 stopped responding long ago
    (tmp_path / "rank-1").write_text(json.dumps({"what": "status exchange", "entered": now, "alive": now + 60}))
    (tmp_path / "rank-2").write_text(json.dumps({"what": "assembly", "entered": now - 100, "alive": now - 100}))
    wd.step = 7
    with wd.waiting("status exchange"):
        (tmp_path / "rank-1").write_text(json.dumps({"what": "status exchange", "entered": now, "alive": now + 60}))
        assert fired.wait(10)
    assert codes == [EXIT_CODE]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "rank 0 made no progress for 0.3 s in 'status exchange' (step 7), waiting for rank(s) [2]" in message
    assert "rank 1 in 'status exchange'" in message and "rank 2 not responding" in message


def test_progress_inside_a_phase_and_nested_exchanges_keep_it_alive(tmp_path):
    # 1.5 s, beats 0.1 s apart: a loaded machine may pause the test for a second (0.5 s fired: 1 run in ~30)
    wd, fired, codes = _watchdog(tmp_path, timeout=1.5)
    with wd.waiting("assembly", [0, 1]):
        for _ in range(20):  # 20 tensors, 0.1 s apart: 2 s in all, never 1.5 s without one
            assert not fired.wait(0.1)
            wd.beat()
            with wd.waiting("assembly: replica digests", [0, 1]):
                pass  # a nested exchange returns to the outer phase, clock restarted
    assert not fired.wait(1.8) and codes == []  # outside any collective nothing is watched
    assert json.loads((tmp_path / "rank-0").read_text())["what"] == "assembly: replica digests"
    wd.close()


def test_closing_removes_each_ranks_progress_file_and_the_last_removes_the_directory(tmp_path):
    progress = tmp_path / ".fullparam-progress"
    progress.mkdir()
    dogs = [Watchdog(5, r, [0, 1], progress, exit_fn=lambda code: None) for r in (0, 1)]
    for wd in dogs:
        with wd.waiting("status exchange"):
            pass
    assert sorted(p.name for p in progress.iterdir()) == ["rank-0", "rank-1"]
    (tmp_path / "keep.txt").write_text("not the watchdog's")
    dogs[0].close()
    assert sorted(p.name for p in progress.iterdir()) == ["rank-1"]  # rank 1 still runs: its file stays
    dogs[1].close()
    assert not progress.exists() and (tmp_path / "keep.txt").exists()


def test_a_collective_that_fails_because_a_peer_ended_names_the_peer_that_stopped(tmp_path, caplog):
    """The first watchdogs to fire end their ranks; a rank whose own has not fired yet sees gloo's
    'Connection reset by peer' instead: it names the stopped rank all the same, and the error goes on."""
    wd, fired, codes = _watchdog(tmp_path, timeout=30)
    now = time.time()
    (tmp_path / "rank-1").write_text(json.dumps({"what": "status exchange", "entered": now, "alive": now + 60}))
    (tmp_path / "rank-2").write_text(json.dumps({"what": "assembly", "entered": now - 100, "alive": now - 100}))
    wd.step = 3
    try:
        with wd.waiting("status exchange"):
            raise ValueError("(InvalidArgument) TCP receive error. Details: Connection reset by peer.\nmore")
    except ValueError as e:
        assert "Connection reset" in str(e)
    else:
        raise AssertionError("the collective's error was swallowed")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert ("rank 0's 'status exchange' (step 3) failed after 0 s (ValueError: (InvalidArgument) TCP receive error. "
            "Details: Connection reset by peer.), waiting for rank(s) [2]") in message, message
    assert "rank 2 not responding" in message and codes == [] and not fired.is_set()
    wd.close()


def test_a_collective_that_fails_with_every_peer_alive_adds_nothing(tmp_path, caplog):
    wd, _, codes = _watchdog(tmp_path, timeout=30)
    now = time.time()
    for r in (1, 2):
        (tmp_path / f"rank-{r}").write_text(json.dumps({"what": "status exchange", "entered": now + 1, "alive": now + 60}))
    try:
        with wd.waiting("status exchange"):
            raise RuntimeError("a bug of ours")
    except RuntimeError:
        pass
    assert not [r for r in caplog.records if "failed after" in r.getMessage()] and codes == []
    wd.close()


def test_when_one_watchdog_ends_the_job_every_waiting_rank_says_what_it_waited_for(tmp_path, caplog):
    """Rank 0's clock runs out first; rank 1, waiting with a clock of 30 s in another collective, sees the
    mark rank 0 leaves before the launcher would stop it, names the stopped rank 2 the same way, and ends."""
    first, fired0, codes0 = _watchdog(tmp_path, rank=0, timeout=0.3)
    (tmp_path / "ended").write_text(json.dumps({"rank": 1, "time": 0}))  # an earlier job's mark: rank 1 clears it
    other, fired1, codes1 = _watchdog(tmp_path, rank=1, timeout=30)
    assert not (tmp_path / "ended").exists()
    now = time.time()
    (tmp_path / "rank-2").write_text(json.dumps({"what": "assembly", "entered": now - 100, "alive": now - 100}))
    first.step = other.step = 4
    done = threading.Event()

    def rank1():
        with other.waiting("assembly", [1, 2]):
            done.wait(20)

    t = threading.Thread(target=rank1)
    t.start()
    try:
        with first.waiting("status exchange", [0, 1]):
            assert fired0.wait(10) and fired1.wait(10)
    finally:
        done.set()
        t.join()
    assert codes0 == codes1 == [EXIT_CODE]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert re.search(r"rank 1's 'assembly' \(step 4\) failed after \d+ s \(rank 0's watchdog is ending the job\), "
                     r"waiting for rank\(s\) \[2\] \(rank 2 not responding", message), message
