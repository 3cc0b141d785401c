"""The snapshot writer's threads and copies (export/write/): results, bounds, failures, aborts."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

from paddle_fullparam_callbacks.export.write import checksum, syscalls, writer
from paddle_fullparam_callbacks.host.copy import copy_into, row_blocks
from paddle_fullparam_callbacks.export.write.header import read_tensor
from paddle_fullparam_callbacks.export.write.pipeline import BlockPool, Stopped
from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

DTYPE_NAME = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.int64): "int64",
              np.dtype(np.uint16): "bfloat16"}


def writer_threads():
    """A writer's own threads (the process's worker pool, host/pool.py, lives as long as the process)."""
    return [t for t in threading.enumerate() if t.name.startswith("pfc-") and not t.name.startswith("pfc-work")
            and t.is_alive()]


@pytest.fixture(autouse=True)
def no_threads_left_behind():
    before = set(writer_threads())
    yield
    for t in set(writer_threads()) - before:
        t.join(5)
    assert not set(writer_threads()) - before, "a writer thread outlived its writer"


@pytest.fixture
def small_blocks(monkeypatch):
    """Many pieces per tensor and a pool of two buffers: every path of the pipeline runs."""
    monkeypatch.setattr(writer, "_BLOCK_BYTES", 4096)
    monkeypatch.setattr(writer, "_POOL_BLOCKS", 2)
    monkeypatch.setattr(writer, "_BLOCKS_PER_THREAD", 0)
    monkeypatch.setattr(writer, "_PIECE_BYTES", 8192)
    monkeypatch.setattr(writer, "_WRITEBACK_EVERY", 16384)


# ---- copies ------------------------------------------------------------------------------------
def _views():
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "aliasing-pitch-f32": f32(1024, 40).T,  # source pitch 4096 bytes: column strips
        "aliasing-pitch-u16": rng.integers(0, 2**16, (2048, 33)).astype(np.uint16).T,
        "other-pitch-f32": f32(300, 70).T,  # square tiles
        "other-pitch-f16": f32(130, 90).astype(np.float16).T,
        "f64": rng.standard_normal((64, 100)).T,
        "small": f32(5, 7).T,
        "column-slice": f32(200, 300)[:, ::3],
        "3d": f32(6, 20, 50).transpose(2, 0, 1),
        "reversed": f32(100, 80)[::-1].T,
        "one-row": f32(5000, 1).T,
        "contiguous": f32(40, 50),
    }


@pytest.mark.parametrize("name", list(_views()))
def test_copy_into_is_exact(name):
    src = _views()[name]
    dst = np.empty(src.shape, src.dtype)
    copy_into(dst, src)
    assert dst.tobytes() == np.ascontiguousarray(src).tobytes()


def test_copy_into_keeps_nan_payloads_and_denormals():
    bits = np.arange(2**20, dtype=np.uint32).reshape(1024, 1024) * 4093 + 0x7F800001  # NaNs, signalling too
    bits[::7] = np.arange(1024, dtype=np.uint32)  # denormals
    src = bits.view(np.float32).T
    dst = np.empty(src.shape, np.float32)
    copy_into(dst, src)
    assert dst.view(np.uint32).tobytes() == np.ascontiguousarray(bits.T).tobytes()


def test_row_blocks_cover_every_row_once():
    a = np.zeros((37, 5), np.float32)
    blocks = list(row_blocks(a, 100))
    assert blocks[0] == (0, 5) and blocks[-1][1] == 37
    assert all(b[1] == c[0] for b, c in zip(blocks, blocks[1:]))
    assert list(row_blocks(a, 1)) == [(r, r + 1) for r in range(37)]  # at least one row
    assert list(row_blocks(np.zeros(()), 8)) == [(0, 1)]
    assert list(row_blocks(np.zeros((0, 3)), 8)) == [(0, 0)]


# ---- the pool ----------------------------------------------------------------------------------
def test_block_pool_bounds_buffers_and_wakes_on_stop():
    stop = threading.Event()
    pool = BlockPool(64, 2, stop.is_set)
    a, give_a = pool.get(64)
    b, give_b = pool.get(10)
    assert a is not b
    got = []
    t = threading.Thread(target=lambda: got.append(pool.get(64)))
    t.start()
    t.join(0.05)
    assert t.is_alive() and not got  # two buffers out: the third waits
    give_a()
    t.join(5)
    assert got and got[0][0] is a  # reused, not a new one
    big = []
    t = threading.Thread(target=lambda: big.append(pool.get(1000)))
    t.start()
    t.join(0.05)
    assert t.is_alive() and not big  # a buffer larger than the pool's waits until it is the only one out
    give_b()
    got[0][1]()
    t.join(5)
    assert big and len(big[0][0]) == 1000
    big[0][1]()
    x, _ = pool.get(8)
    y, _ = pool.get(8)
    errors = []

    def blocked():
        try:
            pool.get(8)
        except Stopped:
            errors.append("stopped")

    t = threading.Thread(target=blocked)
    t.start()
    t.join(0.05)
    assert t.is_alive()
    stop.set()
    pool.wake()
    t.join(5)
    assert errors == ["stopped"]


# ---- whole writer ------------------------------------------------------------------------------
def _plan_and_arrays(max_shard=60_000):
    rng = np.random.default_rng(3)
    arrays = {
        "a.weight": rng.standard_normal((64, 48)).astype(np.float32).T,  # strided
        "b.weight": rng.standard_normal((40, 30)).astype(np.float32),  # contiguous
        "c.weight": rng.integers(0, 2**16, (1024, 12)).astype(np.uint16).T,  # bf16, aliasing pitch
        "d.bias": rng.standard_normal(50).astype(np.float32),
        "e.weight": rng.standard_normal((90, 70)).astype(np.float16).T,
        "f.scalar": np.array(7, np.int64),
    }
    specs = [TensorSpec(n, a.shape, DTYPE_NAME[a.dtype]) for n, a in arrays.items()]
    return build_export_plan(specs, max_shard), arrays


def _in_file_order(plan):
    return [s.name for f in plan.files for s in sorted(f.slots, key=lambda s: s.begin)]


@pytest.mark.parametrize("order", ["file", "reverse"])
@pytest.mark.parametrize("background", [True, False], ids=["bg", "fg"])
def test_pieces_round_trip_with_stats_and_releases(tmp_path, small_blocks, order, background):
    plan, arrays = _plan_and_arrays()
    names = _in_file_order(plan)
    released = []
    w = SnapshotWriter(plan, tmp_path, background=background, max_pending_bytes=1 << 20)
    for n in names if order == "file" else names[::-1]:
        w.put(n, arrays[n], release=lambda n=n: released.append(n))
    results = w.close()
    assert sorted(released) == sorted(arrays)  # each exactly once
    for f in plan.files:
        path = tmp_path / f.name
        assert results[f.name].digest == checksum.digest_of_file(path)
        assert path.stat().st_size == f.total_bytes
    for n, a in arrays.items():
        path = tmp_path / plan.files[plan.slots[n].file_index].name
        assert read_tensor(path, n).tobytes() == np.ascontiguousarray(a).tobytes(), n
    st = w.stats
    assert st["bytes_written"] == sum(a.nbytes for a in arrays.values())
    assert st["bytes_copied"] == sum(a.nbytes for a in arrays.values() if not a.flags.c_contiguous)
    assert st["blocks"] > len(arrays) and st["elapsed_s"] > 0
    if order == "file":
        assert st["bytes_hashed"] == st["bytes_written"]
    if background:
        assert st.get("writebacks", 0) >= 1


class _Boom(OSError):
    pass


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_failed_pwrite_is_reported_and_files_removed(tmp_path, small_blocks, monkeypatch, fail_at):
    plan, arrays = _plan_and_arrays()
    real, calls = writer._pwrite_all, {"n": 0}

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise _Boom(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(writer, "_pwrite_all", failing)
    released = []
    w = SnapshotWriter(plan, tmp_path, max_pending_bytes=1 << 20)
    with pytest.raises(OSError, match="No space left on device"):
        for n in _in_file_order(plan):
            w.put(n, arrays[n], release=lambda n=n: released.append(n))
        w.close()
    w.abort()  # what the exporter does after an error; twice is harmless
    assert os.listdir(tmp_path) == []
    assert len(released) == len(set(released))  # never twice


def test_failed_hash_is_reported(tmp_path, small_blocks, monkeypatch):
    plan, arrays = _plan_and_arrays()

    class Hasher:
        def __init__(self, data=b""):
            self.n = 0

        def update(self, b):
            self.n += 1
            if self.n == 3:
                raise ValueError("hash broke")

        def hexdigest(self):
            return "0" * 64

    monkeypatch.setattr(writer.checksum, "new", lambda algorithm, data=b"": Hasher())
    w = SnapshotWriter(plan, tmp_path)
    with pytest.raises(OSError, match="hash broke"):
        for n in _in_file_order(plan):
            w.put(n, arrays[n])
        w.close()
    assert os.listdir(tmp_path) == []


def test_failed_fsync_is_reported(tmp_path, small_blocks, monkeypatch):
    plan, arrays = _plan_and_arrays()
    real = os.fsync
    target = {os.path.join(str(tmp_path), f.name) for f in plan.files}

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}") in target:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    w = SnapshotWriter(plan, tmp_path)
    for n in _in_file_order(plan):
        w.put(n, arrays[n])
    with pytest.raises(OSError, match="Input/output error"):
        w.close()
    assert os.listdir(tmp_path) == []


def test_full_disk_fails_at_allocation_before_any_data(tmp_path, monkeypatch):
    plan, arrays = _plan_and_arrays()
    monkeypatch.setattr(writer, "allocate", lambda fd, n: (_ for _ in ()).throw(OSError(28, "No space left")))
    w = SnapshotWriter(plan, tmp_path)
    with pytest.raises(OSError, match="No space left"):
        for n in _in_file_order(plan):
            w.put(n, arrays[n])
        w.close()
    assert os.listdir(tmp_path) == []


def test_allocate_reserves_the_file_size(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        done = syscalls.allocate(fd, 12345)
        assert os.fstat(fd).st_size == (12345 if done else 0)
        syscalls.start_writeback(fd)  # harmless anywhere
    finally:
        os.close(fd)


def test_abort_unblocks_a_producer_and_a_writer_waiting_for_buffers(tmp_path, small_blocks, monkeypatch):
    """The disk hangs: the pool runs dry, the writer thread waits for a buffer, the producer for
    budget. abort() from elsewhere ends all of it (once the hung write returns) and removes the files."""
    plan, arrays = _plan_and_arrays()
    gate, entered = threading.Event(), threading.Event()
    real = writer._pwrite_all

    def hanging(fd, data, offset):
        if offset > 0:  # the header goes through
            entered.set()
            gate.wait(10)
        return real(fd, data, offset)

    monkeypatch.setattr(writer, "_pwrite_all", hanging)
    w = SnapshotWriter(plan, tmp_path, max_pending_bytes=8192)
    released = []

    def produce():
        for n in _in_file_order(plan):
            w.put(n, arrays[n], release=lambda n=n: released.append(n))

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    assert entered.wait(5)
    producer.join(0.1)
    assert producer.is_alive()  # held back by the budget
    threading.Timer(0.2, gate.set).start()
    w.abort()
    producer.join(5)
    assert not producer.is_alive()
    assert os.listdir(tmp_path) == []
    assert len(released) == len(set(released))


def test_pool_is_sized_to_the_work(monkeypatch):
    """A writer of few bytes holds a small copy pool (a buffer per thread and one more), one of many bytes
    the whole max(_POOL_BLOCKS, _BLOCKS_PER_THREAD x threads)."""
    for name, value in (("_BLOCK_BYTES", 2 * 2**20), ("_POOL_BLOCKS", 8), ("_BLOCKS_PER_THREAD", 3), ("_POOL_SHARE", 128)):
        monkeypatch.setattr(writer, name, value)
    assert writer.pool_blocks(2, 10**6) == 3 and writer.pool_blocks(1, 0) == 2
    assert writer.pool_blocks(2, 673 * 10**6) == 3  # the convert benchmark's checkpoint: 6 MB, not 16
    assert writer.pool_blocks(2, 5 * 256 * 2**20) == 5
    assert writer.pool_blocks(2, 4 * 2**30) == 8 and writer.pool_blocks(4, 4 * 2**30) == 12


def test_peak_copy_memory_is_the_pool(tmp_path, monkeypatch):
    """A large transposed tensor passes through at most pool_blocks(threads, bytes) blocks of copies."""
    monkeypatch.setattr(writer, "_BLOCK_BYTES", 1 << 16)
    monkeypatch.setattr(writer, "_POOL_BLOCKS", 3)
    made = []
    real_empty = np.empty

    def counting_empty(shape, dtype=float, *a, **k):
        out = real_empty(shape, dtype, *a, **k)
        if np.dtype(dtype) == np.uint8:
            made.append(out.nbytes)
        return out

    import paddle_fullparam_callbacks.export.write.pipeline as wp

    monkeypatch.setattr(wp.np, "empty", counting_empty)
    x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32).T  # 2 MB, 32 blocks
    plan = build_export_plan([TensorSpec("x", x.shape, "float32")], 10**9)
    w = SnapshotWriter(plan, tmp_path)
    w.put("x", x)
    w.close()
    bound = writer.pool_blocks(w.threads, plan.files[0].data_bytes)
    blocks = [n for n in made if n == 1 << 16]
    stages = [n for n in made if n != 1 << 16]  # each worker's stage of host/copy.py, made once and reused
    assert w._pool.count == bound and len(blocks) <= bound
    assert len(stages) <= w.threads and all(n <= 1 << 20 for n in stages)
    assert load_file(str(tmp_path / plan.files[0].name))["x"].tobytes() == np.ascontiguousarray(x).tobytes()


# ---- a padding row written as zeros, without a copy of the tensor ---------------------------------
@pytest.mark.parametrize("row", [0, 17, 63])
@pytest.mark.parametrize("background", [True, False], ids=["bg", "fg"])
def test_zero_row_is_written_as_zeros(tmp_path, small_blocks, background, row):
    rng = np.random.default_rng(5)
    arrays = {"emb.weight": rng.standard_normal((64, 48)).astype(np.float32),
              "head.weight": rng.standard_normal((48, 64)).astype(np.float32).T}
    before = {n: np.array(a, copy=True) for n, a in arrays.items()}
    plan = build_export_plan([TensorSpec(n, a.shape, "float32") for n, a in arrays.items()], 10**6)
    w = SnapshotWriter(plan, tmp_path, background=background)
    with pytest.raises(ValueError, match=r"row 64 to zero is not a row of \[64, 48\]"):
        w.put("emb.weight", arrays["emb.weight"], zero_row=64)
    for n in _in_file_order(plan)[::-1]:  # the second one waits in the stash with its row
        w.put(n, arrays[n], zero_row=row)
    results = w.close()
    path = tmp_path / plan.files[0].name
    assert results[plan.files[0].name].digest == checksum.digest_of_file(path)
    for n, a in arrays.items():
        expected = np.array(a, copy=True)
        expected[row] = 0
        assert read_tensor(path, n).tobytes() == expected.tobytes(), n
        assert np.array_equal(a, before[n])  # the producer's memory is not touched


# ---- the worker threads (export.threads) ----------------------------------------------------------
def test_any_number_of_workers_writes_the_same_bytes_lazy_arrays_included(tmp_path, small_blocks):
    """1, 3 and 6 workers (more than this machine's cores): the same files, byte for byte, with lazy arrays
    (a cast computed block by block, one with a padding row zeroed) among strided and contiguous tensors."""
    from paddle_fullparam_callbacks.host.lazy import CastArray

    plan, arrays = _plan_and_arrays()
    rng = np.random.default_rng(9)
    f32 = rng.standard_normal((96, 40)).astype(np.float32)
    lazies = {"g.weight": CastArray(f32.T, "float32", "bfloat16", np.dtype(np.uint16)),  # transposed source
              "h.weight": CastArray(f32, "float32", "float16", np.dtype(np.float16))}  # Paddle's kernel
    specs = [TensorSpec(n, a.shape, DTYPE_NAME[np.dtype(a.dtype)]) for n, a in {**arrays, **lazies}.items()]
    plan = build_export_plan(specs, 60_000)
    digests = []
    for threads in (1, 3, 6):
        out = tmp_path / f"t{threads}"
        out.mkdir()
        w = SnapshotWriter(plan, out, threads=threads, max_pending_bytes=1 << 20)
        assert w.threads == threads
        for n in _in_file_order(plan):
            w.put(n, {**arrays, **lazies}[n], zero_row=5 if n == "h.weight" else None)
        results = w.close()
        digests.append([results[f.name].digest for f in plan.files])
        for n, a in {**arrays, **lazies}.items():
            want = np.array(a, copy=True)
            if n == "h.weight":
                want[5] = 0
            got = read_tensor(out / plan.files[plan.slots[n].file_index].name, n)
            assert got.tobytes() == want.tobytes(), (threads, n)
        assert w.stats["bytes_filled"] == sum(a.nbytes for a in lazies.values()) - lazies["h.weight"][5].nbytes
    assert digests[0] == digests[1] == digests[2]


def test_pool_size_rule_and_batches(monkeypatch):
    from paddle_fullparam_callbacks.host import pool

    for var in ("PADDLE_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):  # the suite may itself run under a launcher
        monkeypatch.delenv(var, raising=False)
    assert pool.local_ranks({"PADDLE_LOCAL_SIZE": "4"}) == 4 and pool.local_ranks({"PADDLE_LOCAL_SIZE": "x"}) == 1
    assert pool.default_threads({"PADDLE_LOCAL_SIZE": str(10 * pool.usable_cores())}) == 1  # never 0
    assert pool.default_threads({}) == pool.usable_cores() == pool.resolve_threads("auto")
    assert pool.resolve_threads(3) == 3
    workers = pool.WorkerPool(2)
    try:
        seen, lock = [], threading.Lock()

        def task(i):
            def run():
                with lock:
                    seen.append(i)
                if i == 7:
                    raise ValueError("task 7")
                workers.run([lambda: None, lambda: None])  # from a worker: inline, never a wait on the queue
            return run

        with pytest.raises(ValueError, match="task 7"):
            workers.run([task(i) for i in range(12)])
        assert 7 in seen
        done = []
        workers.run([lambda i=i: done.append(i) for i in range(20)])
        assert sorted(done) == list(range(20))
    finally:
        workers.close()
