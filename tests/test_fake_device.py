"""The fake accelerator itself (fake_device/, tests/_fake_device.py): build and cache, one process
(round trips, Paddle's allocator statistics, out of memory, which ops fall back or fail), and the
shared-memory communicator with real launches: 2 ranks (with a timeout and a dead peer), 4 ranks
under fleet.init mp2 x pp2, and two 2-rank jobs at once. Runs in both environments."""
from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from _fake_device import DEVICE, LIBRARY, device_env, launch, library

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "multirank" / "fake_device_job.py"
SHM = Path("/dev/shm")


def bf16_bits(values) -> list:
    """float32 -> bfloat16 bit patterns, round to nearest even (NaN-free input)."""
    u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tolist()


def bf16_round(values) -> list:
    return (np.array(bf16_bits(values), dtype=np.uint32) << 16).view(np.float32).astype(float).tolist()


def segments_of(pids) -> list:
    return sorted(p.name for p in SHM.glob("fakedev.*") if p.name.split(".")[1] in {str(x) for x in pids})


# ------------------------------------------------------------------------------------------------
# build, cache, single process
# ------------------------------------------------------------------------------------------------


def test_build_prints_two_lines_and_is_cached(fake_device):
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fake_device.sh"), "--python", sys.executable],
                         capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [f"CUSTOM_DEVICE_ROOT={fake_device}", f"DEVICE={DEVICE}"]
    assert "building" not in out.stderr, "a second call rebuilt the plugin"
    assert sorted(p.name for p in fake_device.iterdir()) == ["kernels", LIBRARY]  # Paddle loads no subfolder
    assert sorted(p.name for p in (fake_device / "kernels").iterdir()) == [LIBRARY, "libfakedev_kernels.so"]
    # keyed by Paddle version and Python tag, outside the clone, beside the environments
    import importlib.metadata

    assert fake_device.name.startswith(f"paddle{importlib.metadata.version('paddlepaddle')}-"
                                       f"cp{sys.version_info[0]}{sys.version_info[1]}-")
    env_root = subprocess.run(["bash", str(ROOT / "scripts" / "env.sh"), "--root"], capture_output=True,
                              text=True, check=True).stdout.strip()
    assert fake_device.parent == Path(env_root).parent / "fake_device"
    assert ROOT not in fake_device.parents


def test_one_process(fake_device, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_fake_device_single.py")], cwd=tmp_path,
                          env=device_env(count=3, memory_mb=64), capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAKEDEV_SINGLE ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(lines[0].split(" ", 1)[1])

    assert r["types"] == [DEVICE]
    assert r["available"] == ["fakedev:0", "fakedev:1", "fakedev:2"]  # FAKEDEV_COUNT=3
    f32 = np.array([0.0, -0.0, 1.5, -2.25, 3.4e38, 1e-45, np.inf, np.nan], dtype=np.float32)
    assert r["f32_place"] == "Place(fakedev:0)"
    assert r["f32_bits"] == r["f32_cpu_bits"] == f32.view(np.uint32).tolist()
    assert r["bf16_place"] == "Place(fakedev:0)"
    assert r["bf16_bits"] == bf16_bits(f32[:6])
    assert r["bf16_back"] == bf16_round(f32[:6])
    assert r["i64"] == [0, -1, 2**62 + 7, -(2**63), 2**63 - 1]
    assert (r["second_device_place"], r["device_to_device"]) == ("Place(fakedev:2)", "Place(fakedev:1)")

    # Paddle's statistics: exact, rounded up to 256 bytes; back down after free; peak and its reset
    assert r["delta_1mib"] == 1 << 20
    assert r["delta_odd"] == 1_000_192  # 1_000_004 rounded up to a multiple of 256
    assert r["peak_after_two"] == r["peak_kept"] == (1 << 20) + 1_000_192
    assert r["back_to_before"] == 0
    assert r["peak_after_reset"] == 0

    # out of memory at FAKEDEV_MEMORY_MB=64: Paddle's own error, after dropping its cached 20 MB;
    # the free memory it reports is the capacity minus what Paddle holds from the plugin
    assert r["reserved_with_cache"] >= 30 << 20
    assert r["oom"] == "MemoryError"
    assert r["oom_says"] == ["Out of memory error on fakedev:0", "Cannot allocate 60.000000MB"]
    assert r["reserved_after_oom"] < 11 << 20
    assert r["oom_available_mb"] == pytest.approx((64 * 2**20 - r["reserved_after_oom"]) / 2**20, abs=1e-5)
    assert r["allocated_after_oom"] == 0
    assert r["after_oom_fits"] == "Place(fakedev:0)"

    ops = r["ops"]
    fallback = ["matmul", "add", "softmax", "sum", "randn", "linear_init", "backward", "clone", "concat",
                "split", "cast_bf16", "concat_bf16", "scale_bf16", "sum_bf16"]
    for name in fallback:  # no device kernel: CPU kernels, the result on the device, 256 bytes here
        assert ops[name] == {"ok": True, "alloc": 256, "place": "Place(fakedev:0)", "contiguous": True}, name
    for name in ["reshape", "slice", "transpose", "slice_bf16"]:  # views: no allocation
        assert ops[name]["ok"] and ops[name]["alloc"] == 0 and ops[name]["place"] == "Place(fakedev:0)", name
    assert not ops["transpose"]["contiguous"]
    assert ops["transpose_numpy"]["ok"]
    for name in ["contiguous", "transpose_cpu", "transpose_matmul"]:  # a non-contiguous view needs `contiguous`
        assert not ops[name]["ok"] and "kernel `contiguous` is not registered" in ops[name]["says"], name
    for name in ["add_bf16", "matmul_bf16"]:  # no bfloat16 CPU kernel to fall back to
        assert not ops[name]["ok"] and "fail to fallback to CPU" in ops[name]["says"], name
    assert r["matmul_value"] == [[3.0, 3.0], [12.0, 12.0]]
    assert r["no_stride_transpose"] == {"alloc": 256, "contiguous": True, "place": "Place(fakedev:0)",
                                        "value": [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]}


def test_stale_segments_of_dead_creators_are_removed(fake_device, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = SHM / f"fakedev.{dead_pid}.{'0' * 31}1"
    alive = SHM / f"fakedev.{os.getpid()}.{'0' * 31}2"
    stale.write_bytes(b"x")
    alive.write_bytes(b"x")
    try:
        lib = ctypes.CDLL(str(library()))
        removed = lib.fakedev_cleanup_stale_segments()
        assert not stale.exists()
        assert alive.exists()  # its creator runs
        assert removed >= 1
    finally:
        for p in (stale, alive):
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------
# launches
# ------------------------------------------------------------------------------------------------


def check_job(res, n, base):
    """Every rank's report against values computed here. Returns the reports by rank."""
    reports = dict(res.tagged("FAKEDEV"))
    assert sorted(reports) == list(range(n)), res.describe()
    pids = {r: reports[r]["pid"] for r in range(n)}
    for r, rep in reports.items():
        assert (rep["rank"], rep["world"], rep["backend"]) == (r, n, "xccl")
        assert rep["place"] == f"fakedev:{r}" and rep["all_gather_place"] == f"Place(fakedev:{r})"
        ag = rep["all_gather"]
        f = [[float(base + 100 * k + i) for i in range(5)] for k in range(n)]
        assert ag["float32"] == f
        assert ag["float16"] == [np.array(v, np.float32).astype(np.float16).astype(float).tolist() for v in f]
        assert ag["bfloat16"] == [bf16_round(v) for v in f]
        assert ag["int64"] == [[base * 10**12 + k, -k - 1, 2**40 + k] for k in range(n)]
        for name in ("uint8", "int8"):
            assert ag[name] == [[7 * i + k + base % 97 for i in range(4)] for k in range(n)], name
        assert rep["broadcast"] == [float(base + 1000 * (n - 1) + i) for i in range(3)]
        assert rep["all_reduce_checked"] == 32 and rep["all_reduce_wrong"] == []
        assert rep["all_reduce_big_ok"]
        assert rep["barrier_saw"] == list(range(n))
        assert rep["reduce_scatter"] == [float(10 * n * (n - 1) // 2 + n * (r + base))] * 3
        peer = r + 1 if r % 2 == 0 else r - 1
        assert rep["send_recv_ok"] and rep["send_recv_head"] == [100_000 * peer + base, 100_000 * peer + base + 1]
        assert rep["ring_ok"]
        assert rep["all_gather_object"] == [{"rank": k, "base": base, "pid": pids[k]} for k in range(n)]
        assert rep["broadcast_object_list"] == [{"from": 0, "base": base}, "x"]
        assert rep["alltoall"] == [float(10 * k + r + base) for k in range(n)]
    # every segment was unlinked once its ranks had it mapped
    assert segments_of(pids.values()) == []
    return reports


def test_two_ranks_with_small_buffers_timeout_and_dead_peer(fake_device, tmp_path):
    # 16 KB staging buffers (4 KB mailboxes): every collective and message above takes many steps
    res = launch(JOB, ["--out", tmp_path, "--base", 5, "--failures"], nranks=2, log_dir=tmp_path / "log",
                 timeout=240, fakedev={"comm_buffer_kb": 16})
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = check_job(res, 2, 5)
    failures = res.tagged("FAKEDEV_FAILURES")
    assert [rank for rank, _ in failures] == [0], res.describe()
    f = failures[0][1]
    # alone in a collective: fails after the 3 s timeout, with the plugin's reason in the log, and
    # waiting cost (almost) no CPU
    assert f["timeout_error"] is not None and 2.9 <= f["timeout_s"] < 30, f
    assert f["timeout_cpu_s"] < 0.5, f
    assert "gave up in all_reduce: its peers did not arrive within 3 s" in res.logs[0]
    # the peer exited: noticed within about a second although the timeout was 120 s
    assert f["dead_peer_error"] is not None and f["dead_peer_s"] < 10, f
    assert f"gave up in all_reduce: rank 1 (pid {reports[1]['pid']}) exited" in res.logs[0]


def test_four_ranks_fleet_mp2_pp2(fake_device, tmp_path):
    res = launch(JOB, ["--out", tmp_path, "--base", 0, "--fleet", "1x2x2"], nranks=4, log_dir=tmp_path / "log",
                 timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = check_job(res, 4, 0)
    for r, rep in reports.items():
        mp = [2 * (r // 2), 2 * (r // 2) + 1]  # "model" varies fastest
        pp = [r % 2, r % 2 + 2]
        assert (rep["mp_ranks"], rep["pp_ranks"], rep["dp_ranks"]) == (mp, pp, [r])
        assert rep["mp_all_gather"] == [float(k) for k in mp]
        assert rep["pp_all_gather"] == [float(k) for k in pp]
        # a tensor-parallel forward (its mp all_reduce runs on the calc stream) equals the dense one
        assert rep["tp_place"] == f"Place(fakedev:{r})" and rep["tp_max_err"] < 1e-4, rep


def rendezvous(parties: int) -> int:
    """A port on 127.0.0.1 where ``parties`` ranks connect and block until all of them did."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(300)

    def serve():
        conns = []
        try:
            for _ in range(parties):
                conns.append(server.accept()[0])
            for conn in conns:
                conn.sendall(b"!")
        finally:  # on a timeout the ranks read b"" and fail
            for conn in conns:
                conn.close()
            server.close()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def test_two_jobs_at_once_do_not_share_a_communicator(fake_device, tmp_path):
    before = {p.name for p in SHM.glob("fakedev.*")}
    port = rendezvous(4)  # the 4 ranks of both jobs, once their communicators exist
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch, JOB, ["--out", tmp_path, "--base", base, "--rendezvous", port], nranks=2,
                               log_dir=tmp_path / f"log{base}", timeout=300) for base in (1000, 2000)]
        results = [f.result() for f in futures]
    for res, base in zip(results, (1000, 2000)):
        assert res.rc == 0 and not res.timed_out, res.describe()
        check_job(res, 2, base)  # each job saw only its own ranks' values
    assert {p.name for p in SHM.glob("fakedev.*")} <= before
