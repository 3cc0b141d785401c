"""The start-time visibility proof and the room check, on plain directories (no ranks, no mounts)."""
from __future__ import annotations

import os

from paddle_fullparam_callbacks.export.commit import room, visibility


def test_a_rank_that_sees_the_coordinators_directory_passes_and_leaves_nothing(tmp_path):
    token = visibility.write_token(tmp_path)
    assert visibility.check_visible(tmp_path, token, rank=3) is None
    visibility.remove_token(tmp_path, token)
    assert os.listdir(tmp_path) == []


def test_what_a_rank_that_sees_another_directory_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(visibility, "_READ_PAUSE_S", 0.0)
    token = visibility.write_token(tmp_path)
    other = tmp_path / "elsewhere"
    assert visibility.check_visible(other, token, 1) == "the directory does not exist here"
    other.mkdir()
    assert "exists here but is another one" in visibility.check_visible(other, token, 1)
    (other / f"{visibility.PROBE}{token}").write_text("stale")
    assert visibility.check_visible(other, token, 1) == "the token file holds 'stale', not the coordinator's token"


def test_a_rank_that_cannot_create_files_there_is_named(tmp_path):
    token = visibility.write_token(tmp_path)
    (tmp_path / f"{visibility.PROBE}{token}-rank0").mkdir()  # its own probe name taken: creation fails
    assert visibility.check_visible(tmp_path, token, 0) == "cannot create and remove a file in it (File exists)"


def test_the_message_names_the_directory_ranks_and_hosts():
    results = [(0, "a", None), (1, "a", None), (2, "b", "the directory does not exist here"), (3, "b", "x")]
    message = visibility.unshared_message("snaps", results, "")
    assert message.startswith("'snaps' is not the same directory on every rank: 2 of 4 ranks (hosts b)")
    assert "rank 2 on b: the directory does not exist here; rank 3 on b: x" in message
    assert visibility.unshared_message("snaps", results[:2], "") is None


def test_room_with_a_margin(tmp_path, monkeypatch):
    monkeypatch.setattr(room, "free_bytes", lambda d: 10 << 20)
    assert room.with_margin(100) == 100 + room.MARGIN_MIN
    assert room.with_margin(1 << 30) == (1 << 30) + (1 << 30) // 100
    assert room.shortfall(tmp_path, 9 << 20, "x") is None  # 9 MiB + 1 MiB fit in 10 MiB
    message = room.shortfall(tmp_path, 9_500_000, "the whole snapshot")
    assert "for the whole snapshot: 9.50 MB (9500000 bytes) to write plus a margin of 1.05 MB" in message
    assert "has 10.49 MB (10485760 bytes) free; nothing was written" in message
    assert room.shortfall(tmp_path, 0, "x") is None


def test_free_space_of_a_directory_not_made_yet_is_its_parents(tmp_path, monkeypatch):
    asked = []
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: asked.append(str(p)) or real(p))
    room.free_bytes(tmp_path / "a" / "b")
    assert asked == [str(tmp_path)]  # the nearest existing parent's filesystem (free space itself moves)
