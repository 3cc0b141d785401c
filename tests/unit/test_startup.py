"""What a session claims and proves at start (``export/session/startup.py``), on plain directories:
the coordinator's claim, the visibility proof's verdict, the watchdog's making, an unused output_dir."""
from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from typing import Any, List

import pytest

from paddle_fullparam_callbacks.export import commit
from paddle_fullparam_callbacks.export.commit import visibility
from paddle_fullparam_callbacks.export.commit.watchdog import PROGRESS_DIR
from paddle_fullparam_callbacks.export.session import startup
from paddle_fullparam_callbacks.export.session.distributed import LocalContext
from paddle_fullparam_callbacks.plan.naming import snapshot_step_pattern

PATTERN = snapshot_step_pattern("hf-step-{step:06d}")


@dataclass
class TwoRanks(LocalContext):
    """The coordinator of two ranks; the other rank's part of each exchange is ``other``."""

    world_size: int = 2
    other: Any = None
    asked: List[str] = field(default_factory=list)

    def all_gather_object(self, obj, group=None, what: str = "exchange"):
        self.asked.append(what)
        return [obj, self.other]


@pytest.fixture
def quiet_claims(monkeypatch):
    """No signal handlers or exit hooks installed in the test process; what would have been, recorded."""
    installed = types.SimpleNamespace(signals=[], at_exit=[])
    monkeypatch.setattr(startup, "release_on_signals", installed.signals.append)
    monkeypatch.setattr(startup, "atexit", types.SimpleNamespace(register=installed.at_exit.append))
    yield installed
    for lock in installed.signals:
        lock.release()


def _snapshot(output_dir, name, run_id, seq, created):
    d = output_dir / name
    d.mkdir(parents=True)
    manifest = {"manifest_version": 1, "run": {"id": run_id, "seq": seq}, "created_unix": created}
    (d / commit.MANIFEST).write_text(json.dumps(manifest))


def test_the_claim_takes_the_lock_removes_our_leftovers_and_writes_a_token_per_target(tmp_path, quiet_claims):
    out, ckpts = tmp_path / "snaps", tmp_path / "trainer"
    claim = startup.Claim()
    claim.take(out, PATTERN, False, [("output_dir", out)], holder=None)
    assert claim.created and claim.error is None and claim.removed == [] and claim.run[1] == 1
    assert quiet_claims.signals == [claim.lock] and quiet_claims.at_exit == [claim.lock.release]
    claim.lock.release()

    leftover = commit.new_staging_dir(out, "hf-step-000005", "r0")  # an interrupted export, marked as ours
    (out / ".tmp-someone-elses").mkdir()  # not marked: left alone
    targets = [("output_dir", out), ("checkpoint_hook.enabled", ckpts)]
    again = startup.Claim()
    again.take(out, PATTERN, False, targets, holder=None)
    assert not again.created and again.error is None
    assert again.removed == [leftover.name] and (out / ".tmp-someone-elses").is_dir()
    assert len(again.tokens) == 2 and ckpts.is_dir()  # the trainer's directory is made, to be proven
    for (_, d), token in zip(targets, again.tokens):
        assert (d / f"{visibility.PROBE}{token}").read_text() == token
    assert again.shared == (None, again.run, again.tokens)


def test_a_resumed_job_continues_the_newest_run_and_a_new_one_starts_its_own(tmp_path, quiet_claims):
    out = tmp_path / "snaps"
    _snapshot(out, "hf-step-000010", "older", 4, created=100.0)
    _snapshot(out, "hf-step-000020", "newer", 2, created=200.0)
    resumed = startup.Claim()
    resumed.take(out, PATTERN, True, [], holder=None)
    assert resumed.run == ("newer", 3)
    resumed.lock.release()
    fresh = startup.Claim()
    fresh.take(out, PATTERN, False, [], holder=None)
    assert fresh.run[0] not in ("older", "newer") and fresh.run[1] == 1


def test_a_claim_that_fails_keeps_the_cause_and_whatever_it_took(tmp_path, quiet_claims):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    first = startup.Claim()
    first.take(not_a_dir, PATTERN, False, [], holder=None)
    assert first.lock is None and first.error == ("NotADirectoryError", f"output_dir {str(not_a_dir)!r} is not a directory")

    out = tmp_path / "snaps"
    held = startup.Claim()
    held.take(out, PATTERN, False, [], holder=None)
    second = startup.Claim()
    second.take(out, PATTERN, False, [], holder=None)
    assert second.lock is None and second.error[0] == "OutputDirLocked"
    assert "already used by another export session in this process" in second.error[1]

    # the lock taken, then the trainer's directory cannot be made: the error, with the lock still held
    (tmp_path / "blocker").write_text("x")
    held.lock.release()
    late = startup.Claim()
    late.take(out, PATTERN, False, [("output_dir", out), ("k", tmp_path / "blocker" / "sub")], holder=None)
    assert late.error[0] in ("NotADirectoryError", "FileExistsError") and late.lock is not None and late.tokens == []


def test_a_defect_in_the_claim_is_kept_too_so_no_rank_is_left_waiting(tmp_path, quiet_claims, monkeypatch):
    """Anything that stops the claim, not only an OSError, reaches the start's exchange (raised past it, the
    other ranks would wait there until a timeout); every rank then raises the same error, naming the cause."""
    def broken(*args, **kwargs):
        raise ValueError("a run id that does not parse")

    monkeypatch.setattr(startup, "newest_run", broken)
    claim = startup.Claim()
    claim.take(tmp_path / "snaps", PATTERN, True, [], holder=None)
    assert claim.error == ("ValueError", "a run id that does not parse") and claim.lock is not None
    err = startup.claim_error(*claim.error)
    assert type(err) is RuntimeError and "ValueError: a run id that does not parse" in str(err)
    assert type(startup.claim_error("OutputDirLocked", "m")) is commit.OutputDirLocked
    assert type(startup.claim_error("NotADirectoryError", "m")) is OSError  # every OSError kind: an OSError
    assert type(startup.claim_error("PermissionError", "m")) is OSError


def test_the_proof_passes_without_leaving_a_file_and_times_its_parts(tmp_path):
    ctx, timings = LocalContext(), {}
    assert startup.prove_shared(ctx, [], [], timings) is None and timings == {}
    targets = [("output_dir", tmp_path)]
    assert startup.prove_shared(ctx, targets, [visibility.write_token(tmp_path)], timings) is None
    assert list(tmp_path.iterdir()) == []  # the coordinator removed its token
    assert set(timings) == {"visibility_files_s", "visibility_exchange_s"}


def test_the_first_target_another_rank_cannot_use_is_the_verdict(tmp_path):
    out, ckpts = tmp_path / "snaps", tmp_path / "trainer"
    out.mkdir()
    ckpts.mkdir()
    targets = [("output_dir", out), ("checkpoint_hook.enabled", ckpts)]
    tokens = [visibility.write_token(out), visibility.write_token(ckpts)]
    ctx = TwoRanks(other=[(1, "node1", None), (1, "node1", "the directory does not exist here")])
    key, message = startup.prove_shared(ctx, targets, tokens, {})
    assert ctx.asked == ["visibility proof"] and key == "checkpoint_hook.enabled"
    assert message.startswith(f"the trainer's output_dir (where the checkpoint hook commits) {str(ckpts)!r} is not "
                              "the same directory on every rank: 1 of 2 ranks (hosts node1)")
    assert list(out.iterdir()) == [] and list(ckpts.iterdir()) == []  # tokens removed before the verdict

    tokens = [visibility.write_token(out), visibility.write_token(ckpts)]
    ctx.other = [(1, "node1", "cannot read it (x)"), (1, "node1", "cannot read it (y)")]
    key, message = startup.prove_shared(ctx, targets, tokens, {})
    assert key == "output_dir" and message.startswith(f"{str(out)!r} is not the same directory")


def test_a_watchdog_only_with_several_ranks_and_a_timeout(tmp_path, quiet_claims):
    assert startup.watchdog(30, LocalContext(), tmp_path, None) is None
    assert startup.watchdog(None, TwoRanks(), tmp_path, None) is None
    claim = startup.Claim()
    claim.take(tmp_path, PATTERN, False, [], holder=None)
    wd = startup.watchdog(30, TwoRanks(), tmp_path, claim.lock)
    try:
        assert wd.timeout_s == 30 and wd.world == [0, 1] and wd.rank == 0
        assert wd.progress_dir == tmp_path / PROGRESS_DIR and wd.progress_dir.is_dir()
        assert wd.on_expire == claim.lock.release
    finally:
        wd.close()
    gone = startup.watchdog(30, TwoRanks(), tmp_path / "missing", None)  # no progress directory: no culprit named
    try:
        assert gone.progress_dir is None and gone.on_expire is None
    finally:
        gone.close()


def test_an_unused_output_dir_goes_and_a_used_one_stays(tmp_path):
    unused = tmp_path / "unused"
    (unused / PROGRESS_DIR).mkdir(parents=True)
    (unused / PROGRESS_DIR / "rank-1").write_text("{}")
    startup.remove_unused(unused)
    assert not unused.exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "hf-step-000001").mkdir()
    startup.remove_unused(used)
    assert (used / "hf-step-000001").is_dir()
    startup.remove_unused(tmp_path / "never-made")  # nothing there: nothing to do
