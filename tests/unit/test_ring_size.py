"""The async staging ring's size: the rule (export.max_pending_bytes auto or a size), the session's
use of it (one message when the node's memory caps it), and the writer's budget beside the ring."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from paddle_fullparam_callbacks.config import load_config
from paddle_fullparam_callbacks.export.session import ring_size as rs
from paddle_fullparam_callbacks.export.session.exporters import make_exporter
from paddle_fullparam_callbacks.export.session.session import ExportSession

GB = 10**9


def meminfo(available_bytes: int) -> str:
    return f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {available_bytes // 1024} kB\n"


def test_mem_available_parses_kib_and_misses_cleanly():
    assert rs.mem_available(meminfo(8 * 2**30)) == 8 * 2**30
    assert rs.mem_available("MemTotal: 5 kB\n") is None
    assert rs.mem_available("MemAvailable: lots\n") is None
    assert rs.mem_available(None) is None and rs.mem_available("") is None


def test_auto_holds_the_ranks_bytes_when_the_node_has_room():
    r = rs.ring_size(int(2.2 * GB), None, meminfo(400 * GB), {"PADDLE_LOCAL_SIZE": "8"})
    assert r.bytes == int(2.2 * GB) and not r.capped  # 70B on 64 GPUs: all of it, 25 GB allowed
    assert r.cap == 400 * GB // 1024 * 1024 // 2 // 8 and r.ranks == 8


def test_auto_is_capped_by_half_the_available_memory_shared_among_the_nodes_ranks():
    avail = 16 * 2**30
    r = rs.ring_size(5 * GB, None, meminfo(avail), {"PADDLE_LOCAL_SIZE": "4"})
    assert r.bytes == r.cap == avail // 2 // 4 and r.capped and r.wanted == 5 * GB
    # one rank outside a launcher; torchrun's variable when Paddle's is absent
    assert rs.ring_size(100 * GB, None, meminfo(avail), {}).bytes == avail // 2
    assert rs.ring_size(100 * GB, None, meminfo(avail), {"LOCAL_WORLD_SIZE": "2"}).bytes == avail // 4


def test_auto_without_meminfo_keeps_the_old_default_as_cap():
    r = rs.ring_size(5 * GB, None, None, {})
    assert r.bytes == rs.UNKNOWN_CAP == 512 * 10**6 and r.capped and r.available is None
    assert "unknown" in rs.capped_message(r, 0)


def test_an_explicit_size_wins_over_the_rule():
    tiny = meminfo(1 * 2**20)  # ignored: an explicit size is the user's choice
    assert rs.ring_size(5 * GB, 2 * GB, tiny, {}).bytes == 2 * GB
    assert rs.ring_size(GB, 2 * GB, tiny, {}).bytes == GB  # never more than the rank's bytes
    assert not rs.ring_size(5 * GB, 2 * GB, tiny, {}).capped


def test_a_rank_without_files_keeps_a_one_byte_ring():
    assert rs.ring_size(0, None, meminfo(GB), {}).bytes == 1
    assert rs.ring_size(0, 512, None, {}).bytes == 1
    assert not rs.ring_size(0, None, meminfo(GB), {}).capped


def test_capped_message_names_the_figures_and_the_key():
    r = rs.ring_size(5 * GB, None, meminfo(4 * GB), {"PADDLE_LOCAL_SIZE": "2"})
    msg = rs.capped_message(r, 3)
    for part in ("rank 3", "5.00 GB", "PADDLE_LOCAL_SIZE", "2 rank(s)", "export.max_pending_bytes", "'5GB'"):
        assert part in msg, (part, msg)


# ---- the session and the exporter --------------------------------------------------------------

def _session(overrides, rank_bytes):
    """An ExportSession with only what _host_ring reads: the config, the rank, a prepared plan."""
    s = object.__new__(ExportSession)
    s.config = load_config(None, ["output_dir=/nonexistent", "export.async_write=true", *overrides])
    s.ctx = SimpleNamespace(rank=0)
    s._ring = None
    files = [SimpleNamespace(data_bytes=n) for n in rank_bytes]
    s._prepared = SimpleNamespace(plan=SimpleNamespace(files=files),
                                  writes=SimpleNamespace(files_of_rank=lambda rank: range(len(files))))
    return s


def test_session_ring_auto_holds_the_rank_and_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(rs, "read_meminfo", lambda: meminfo(64 * 2**30))
    s = _session([], [3000, 1500])
    with caplog.at_level(logging.INFO, logger="paddle_fullparam_callbacks"):
        ring = s._host_ring()
    assert ring.size == 4500 and s._host_ring() is ring and not caplog.records


def test_session_ring_auto_capped_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(rs, "read_meminfo", lambda: meminfo(8192))
    monkeypatch.setenv("PADDLE_LOCAL_SIZE", "2")
    s = _session([], [10_000])
    with caplog.at_level(logging.INFO, logger="paddle_fullparam_callbacks"):
        for _ in range(3):
            ring = s._host_ring()
    assert ring.size == 8192 // 2 // 2
    said = [r for r in caplog.records if "staging ring" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "export.max_pending_bytes" in said[0].getMessage()


def test_session_ring_explicit_size(monkeypatch):
    monkeypatch.setattr(rs, "read_meminfo", lambda: pytest.fail("an explicit size reads no meminfo"))
    assert _session(["export.max_pending_bytes=2KB"], [3000, 1500])._host_ring().size == 2000
    assert _session(["export.max_pending_bytes=1MB"], [3000, 1500])._host_ring().size == 4500


def test_session_ring_auto_waits_for_the_plan():
    s = _session([], [10])
    s._prepared = None
    assert s._host_ring() is None and s._ring is None  # prepare() builds it once the rank's bytes are known


@pytest.mark.parametrize("async_write", [True, False])
def test_writer_budget_never_limits_an_async_ring(async_write):
    cfg = load_config(None, ["output_dir=/x", f"export.async_write={str(async_write).lower()}"]).export
    big = SimpleNamespace(size=3 * GB)
    small = SimpleNamespace(size=10**6)
    if async_write:
        # put() waits beyond half the budget: twice the ring lets the whole ring be queued
        assert make_exporter(cfg, ring=big).max_pending_bytes == 6 * GB
        assert make_exporter(cfg, ring=small).max_pending_bytes == 512 * 10**6
    assert make_exporter(cfg, ring=None).max_pending_bytes == 512 * 10**6  # synchronous: the old budget


# ---- issue 47: the ring sized after the first step, and made again smaller when memory falls ------------------

def test_short_of_memory_once_half_of_what_the_rule_left_is_gone():
    # one rank: the rule left as much as the ring took; under half of that, the node is short
    assert not rs.short_of_memory(4 * GB, meminfo(int(2.1 * GB)), {})
    assert rs.short_of_memory(4 * GB, meminfo(int(1.9 * GB)), {})
    # 8 ranks sized one after another from what the earlier ones left: none of them is short
    avail, rings = 64 * GB, []
    for _ in range(8):
        rings.append(rs.ring_size(100 * GB, None, meminfo(avail - sum(rings)), {"PADDLE_LOCAL_SIZE": "8"}).bytes)
    left = meminfo(avail - sum(rings))
    assert not any(rs.short_of_memory(r, left, {"PADDLE_LOCAL_SIZE": "8"}) for r in rings)
    assert not rs.short_of_memory(10**12, None, {})  # MemAvailable unknown: never


def test_session_ring_made_again_smaller_when_the_nodes_memory_falls(monkeypatch, caplog):
    free = {"bytes": 64 * 2**20}
    monkeypatch.setattr(rs, "read_meminfo", lambda: meminfo(free["bytes"]))
    s = _session([], [10_000_000])
    s._shrink_said = False
    first = s._host_ring()
    assert first.size == 10_000_000
    free["bytes"] = 4 * 2**20  # the job grew: 4 MiB left beside a 10 MB ring
    with caplog.at_level(logging.INFO, logger="paddle_fullparam_callbacks"):
        second = s._host_ring()
        again = s._host_ring()  # the new ring is within its share: kept
    # the rule again, from what the node reports then (the real node would count the old ring's memory, freed)
    assert second is not first and second.size == 2 * 2**20 and again is second
    said = [r.getMessage() for r in caplog.records if "fell" in r.getMessage()]
    assert len(said) == 1 and "export.max_pending_bytes" in said[0] and "10.00 MB" in said[0]


def test_an_explicit_ring_is_never_made_again(monkeypatch):
    monkeypatch.setattr(rs, "read_meminfo", lambda: meminfo(1024))
    s = _session(["export.max_pending_bytes=2KB"], [3000])
    s._shrink_said = False
    ring = s._host_ring()
    assert s._host_ring() is ring and ring.size == 2000


def test_stage_ring_waits_for_a_plan_and_for_a_pending_export(monkeypatch):
    monkeypatch.setattr(rs, "read_meminfo", lambda: meminfo(64 * 2**20))
    s = _session([], [5000])
    s._pending = object()
    s.stage_ring()
    assert s._ring is None  # a background export uses the memory: never touched under it
    s._pending, plan = None, s._prepared
    s._prepared = None
    s.stage_ring()
    assert s._ring is None
    s._prepared = plan
    s.stage_ring()
    assert s._ring.size == 5000
