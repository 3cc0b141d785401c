"""Commit protocol (staging, rename, pointers, retention, cleanup) and verify, without Paddle."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from paddle_fullparam_callbacks.export import commit
from paddle_fullparam_callbacks.export.commit import ownership, retention
from paddle_fullparam_callbacks.export.commit.manifest import describe_files
from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot
from paddle_fullparam_callbacks.export.write import checksum
from paddle_fullparam_callbacks.plan.naming import snapshot_step_pattern

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _snapshots import RUN, make_snapshot  # noqa: E402

PATTERN = snapshot_step_pattern("hf-step-{step:06d}")


def test_commit_refuses_a_staging_dir_without_manifest(tmp_path):
    staging = commit.new_staging_dir(tmp_path, "hf-step-000001", RUN)
    with pytest.raises(RuntimeError, match="no fullparam_manifest.json"):
        commit.commit_staging(staging, tmp_path, "hf-step-000001")
    assert not (tmp_path / "hf-step-000001").exists()


def test_listing_ignores_dirs_without_manifest_and_staging(tmp_path):
    make_snapshot(tmp_path, 10)
    (tmp_path / "hf-step-000020").mkdir()  # looks like a snapshot, has no manifest
    commit.new_staging_dir(tmp_path, "hf-step-000030", RUN)
    (tmp_path / "hf-step-000040").mkdir()  # a foreign manifest (not this package's) is not a snapshot either
    (tmp_path / "hf-step-000040" / commit.MANIFEST).write_text('{"step": 40}')
    assert [s.name for s in retention.list_snapshots(tmp_path, PATTERN)] == ["hf-step-000010"]


def test_cleanup_removes_only_marked_leftovers_and_restores_a_displaced_snapshot(tmp_path):
    snap = make_snapshot(tmp_path, 10)
    commit.new_staging_dir(tmp_path, "hf-step-000011", RUN)
    trash = tmp_path / ".trash-hf-step-000001-deadbeef"
    trash.mkdir()
    (trash / "half-deleted.safetensors").write_bytes(b"x")
    ownership.mark(trash, RUN)
    # a crash in the middle of a re-export: the old snapshot was moved aside, the new one not in place
    os.rename(snap, tmp_path / ".replaced-hf-step-000010-0123abcd")
    # the user's own files under names like ours: not provably ours, left alone
    (tmp_path / ".tmp-other").mkdir()
    (tmp_path / ".tmp-other" / "important.txt").write_text("mine")
    (tmp_path / ".trash-notes.txt").write_text("mine too")
    (tmp_path / ".latest.1234").write_text("mine")
    removed, foreign = commit.cleanup_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [".latest.1234", ".tmp-other", ".trash-notes.txt", "hf-step-000010"]
    assert (tmp_path / ".tmp-other" / "important.txt").read_text() == "mine"
    assert len(removed) == 2 and sorted(foreign) == [".tmp-other", ".trash-notes.txt"]
    assert verify_snapshot(tmp_path / "hf-step-000010").ok


def test_deleting_a_snapshot_leaves_a_provably_ours_trash_if_interrupted(tmp_path, monkeypatch):
    snap = make_snapshot(tmp_path, 3)
    deleted = []
    real = os.unlink

    def crash_after_two(path, *a, **k):  # the deletion dies after two files
        if len(deleted) == 2:
            raise KeyboardInterrupt
        deleted.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        ownership.remove_snapshot(snap, RUN)
    monkeypatch.undo()
    (trash,) = [p for p in tmp_path.iterdir() if p.name.startswith(".trash-")]
    assert ownership.is_marked(trash)  # the marker goes last
    removed, foreign = commit.cleanup_stale(tmp_path)
    assert removed == [trash.name] and foreign == [] and os.listdir(tmp_path) == []


def test_retention_keeps_newest_and_never_the_pointer_targets(tmp_path):
    for step in (1, 2, 3, 4, 5):
        make_snapshot(tmp_path, step)
    commit.write_pointer(tmp_path, "best", "hf-step-000001")
    commit.write_pointer(tmp_path, "latest", "hf-step-000005")
    removed = retention.apply_retention(tmp_path, PATTERN, keep_last=2, protect=["hf-step-000003"], run_id=RUN)
    assert removed == ["hf-step-000002"]
    assert [s.step for s in retention.list_snapshots(tmp_path, PATTERN)] == [1, 3, 4, 5]
    assert retention.apply_retention(tmp_path, PATTERN, keep_last=0, run_id=RUN) == []


def test_retention_keeps_the_newest_commits_of_its_own_run_only(tmp_path):
    # an earlier run committed steps 100..500; this run (resumed or new) commits 100 and 200 later
    for i, step in enumerate((100, 200, 300, 400, 500)):
        make_snapshot(tmp_path, step, run="old", seq=i + 1)
    new = [make_snapshot(tmp_path, step, run="new", seq=i + 1) for i, step in enumerate((10, 20, 30))]
    removed = retention.apply_retention(tmp_path, PATTERN, keep_last=2, run_id="new")
    assert removed == [new[0].name]  # only its own oldest commit; the old run's five stay
    assert len(retention.list_snapshots(tmp_path, PATTERN)) == 7
    # within a run the order is the commit order, not the step: a resumed run re-exports step 5 last
    make_snapshot(tmp_path, 5, run="new", seq=4)
    removed = retention.apply_retention(tmp_path, PATTERN, keep_last=2, run_id="new")
    assert removed == ["hf-step-000020"]  # kept: 30 (seq 3) and 5 (seq 4, the newest commit)
    # asked to: other runs' snapshots are counted too
    removed = retention.apply_retention(tmp_path, PATTERN, keep_last=2, run_id="new", other_runs="delete")
    assert sorted(removed) == [f"hf-step-{s:06d}" for s in (100, 200, 300, 400, 500)]


def test_pointer_is_replaced_atomically(tmp_path):
    commit.write_pointer(tmp_path, "latest", "a")
    commit.write_pointer(tmp_path, "latest", "b")
    assert commit.read_pointer(tmp_path, "latest") == "b"
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_check_output_dir_names_the_cause(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(OSError, match="cannot be created"):
        commit.check_output_dir(f / "sub")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        commit.check_output_dir(f)


# ---- verify catches damage -----------------------------------------------------------------

@pytest.fixture
def snap(tmp_path):
    return make_snapshot(tmp_path, 7)


def test_verify_ok(snap):
    r = verify_snapshot(snap)
    assert r.ok and r.tensors == 6 and r.files == len(list(snap.iterdir())) - 1 and r.errors == []


def _shards(snap):
    return sorted(snap.glob("*.safetensors"))


def test_verify_truncated_shard(snap):
    p = _shards(snap)[0]
    p.write_bytes(p.read_bytes()[:-10])
    r = verify_snapshot(snap)
    assert not r.ok and any(p.name in e and "bytes" in e for e in r.errors)


def test_verify_flipped_byte(snap):
    p = _shards(snap)[-1]
    b = bytearray(p.read_bytes())
    b[-3] ^= 1
    p.write_bytes(bytes(b))
    r = verify_snapshot(snap)
    assert [e for e in r.errors if f"{checksum.DEFAULT} differs" in e and p.name in e]


def test_verify_missing_shard(snap):
    p = _shards(snap)[1]
    p.unlink()
    r = verify_snapshot(snap)
    assert any(p.name in e and "missing" in e for e in r.errors)


def test_verify_index_entry_without_tensor_and_tensor_not_indexed(snap):
    idx = json.loads((snap / commit.INDEX).read_text())
    wm = idx["weight_map"]
    name, fname = next(iter(wm.items()))
    wm["ghost.weight"] = fname
    del wm[name]
    (snap / commit.INDEX).write_text(json.dumps(idx))
    # keep the manifest consistent with the edited index so only the tensor checks fire
    m = json.loads((snap / commit.MANIFEST).read_text())
    m["files"][commit.INDEX] = {"bytes": (snap / commit.INDEX).stat().st_size, checksum.DEFAULT: describe_files(snap, [commit.INDEX])[commit.INDEX][1]}
    (snap / commit.MANIFEST).write_text(json.dumps(m))
    errors = verify_snapshot(snap).errors
    assert any("'ghost.weight'" in e and "no such tensor" in e for e in errors)
    assert any(repr(name) in e and "not in model.safetensors.index.json" in e for e in errors)


def test_verify_manifest_missing(snap):
    (snap / commit.MANIFEST).unlink()
    r = verify_snapshot(snap)
    assert not r.ok and any("fullparam_manifest.json: missing" in e for e in r.errors)


# ---- one job per output_dir ------------------------------------------------------------------

def test_a_second_job_on_the_same_output_dir_fails_fast(tmp_path):
    import subprocess
    import sys

    # another live process holds the lock (it waits on its stdin, no sleep)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from paddle_fullparam_callbacks.export import commit; "
                               f"l = commit.acquire_lock(__import__('pathlib').Path({str(tmp_path)!r})); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        leftover = commit.new_staging_dir(tmp_path, "hf-step-000001", "other")  # the other job's export in flight
        with pytest.raises(commit.OutputDirLocked, match=rf"in use by another job \(host .*, pid {holder.pid}"):
            commit.acquire_lock(tmp_path)
        assert leftover.exists()  # nothing of the other job was touched
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # the holder is gone: its stale lock is taken over
    lock = commit.acquire_lock(tmp_path)
    assert lock.path == tmp_path / commit.LOCK
    # a second writer in this process (another callback on the same directory) is refused too
    with pytest.raises(commit.OutputDirLocked, match=r"already used by .* in this process"):
        commit.acquire_lock(tmp_path)
    lock.release()
    assert not (tmp_path / commit.LOCK).exists()
    commit.acquire_lock(tmp_path).release()  # free again


@pytest.mark.parametrize("damage, message", [
    ("overlap", "overlaps the tensor before it"),
    ("past_end", "runs past the end of the file"),
])
def test_verify_bad_header_offsets(tmp_path, damage, message):
    snap = make_snapshot(tmp_path, 7, shard=10_000)  # one file holding all six tensors
    p = _shards(snap)[0]
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    first = header[names[0]]
    assert len(names) == 6
    if damage == "overlap":
        second = header[names[1]]
        shift = second["data_offsets"][0] - first["data_offsets"][0]
        second["data_offsets"] = [second["data_offsets"][0] - shift // 2, second["data_offsets"][1] - shift // 2]
    else:  # the last tensor claims 4 KB more than the file holds
        last = max((header[k] for k in names), key=lambda e: e["data_offsets"][1])
        last["data_offsets"] = [last["data_offsets"][0], last["data_offsets"][1] + 4096]
        last["shape"] = [last["shape"][0] + 4096 // (4 * last["shape"][1]), last["shape"][1]]
    text = json.dumps(header).encode()
    text += b" " * ((-len(text)) % 8)
    p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    errors = verify_snapshot(snap).errors
    assert any(p.name in e and message in e for e in errors), errors


def test_a_lock_of_another_host_is_taken_over_only_when_it_went_stale(tmp_path, caplog):
    from paddle_fullparam_callbacks.export.commit import lock as lockmod

    path = tmp_path / commit.LOCK
    path.write_text(json.dumps({"host": "node-that-was-preempted", "pid": 4242, "since": "2026-11-30T00:00:00Z"}))
    # refreshed recently: its job may be alive on the other host
    with pytest.raises(commit.OutputDirLocked, match=r"in use by another job \(host node-that-was-preempted, pid 4242.*"
                                                     r"a lock not refreshed for 300 s is taken over"):
        commit.acquire_lock(tmp_path)
    # not refreshed for longer than STALE_S: its job is gone, the lock is taken over with a warning
    old = path.stat().st_mtime - lockmod.STALE_S - 5
    os.utime(path, (old, old))
    lock = commit.acquire_lock(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert any("taking over the lock" in r.getMessage() and "node-that-was-preempted" in r.getMessage() for r in caplog.records)
    lock.release()


def test_a_live_holder_refreshes_its_lock(tmp_path):
    lock = commit.acquire_lock(tmp_path)
    assert lock._thread.is_alive()  # the heartbeat calls refresh() every REFRESH_S
    old = lock.path.stat().st_mtime - 1000
    os.utime(lock.path, (old, old))
    lock.refresh()
    assert lock.path.stat().st_mtime > old + 900
    lock.release()
    assert not lock._thread.is_alive() or lock._stop.is_set()


def test_a_lock_released_while_its_process_takes_another_does_not_deadlock(tmp_path):
    """A garbage collection inside acquire_lock() runs the finalizer of an earlier session's lock, which
    releases it on the same thread, with the registry's guard held (seen: a test suite hung there)."""
    import gc
    import threading

    from paddle_fullparam_callbacks.export.commit import lock as lockmod

    class Session:  # the owner whose collection releases its lock
        pass

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    owner = Session()
    first = lockmod.acquire_lock(tmp_path / "a", holder=owner)
    done = []

    def take_second():
        real_init = lockmod.OutputDirLock.__init__

        def init(self, *args, **kwargs):  # the collection happens while the guard is held
            nonlocal owner
            owner = None
            gc.collect()
            real_init(self, *args, **kwargs)

        lockmod.OutputDirLock.__init__ = init
        try:
            done.append(lockmod.acquire_lock(tmp_path / "b"))
        finally:
            lockmod.OutputDirLock.__init__ = real_init

    t = threading.Thread(target=take_second, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "acquire_lock deadlocked on the release of a collected session's lock"
    assert not (tmp_path / "a" / lockmod.LOCK).exists() and (tmp_path / "b" / lockmod.LOCK).exists()
    done[0].release()
    first.release()


def test_the_mapped_checksum_is_the_streamed_one_and_catches_the_same_damage(tmp_path):
    """The serving agent hashes through memory maps on every core: the same digests, the same verdicts."""
    for size in (0, 1, 3 * 2**20 + 7):
        p = tmp_path / f"f{size}"
        p.write_bytes(os.urandom(size))
        for algorithm in checksum.ALGORITHMS:
            with open(p, "rb") as f:
                assert checksum.digest_of_mapped(f, algorithm) == checksum.digest_of_stream(open(p, "rb"), algorithm)
    snap = make_snapshot(tmp_path, 3, n=40, shard=2000)
    assert verify_snapshot(snap, mapped=True).ok
    shard = sorted(snap.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x10
    shard.write_bytes(bytes(data))
    for mapped in (False, True):
        errors = verify_snapshot(snap, mapped=mapped).errors
        assert errors == [f"{shard.name}: blake3 differs from the manifest (the file was changed or damaged)"]
