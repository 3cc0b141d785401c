"""No wait a ring can cause (issue 42): a background export whose staging ring is capped, with tensors that arrive
out of file order (kept by the writer for later, holding the front of the ring) and one larger than half the ring,
finishes without waiting for ``HostRing.wait_s`` and writes the synchronous export's bytes, whatever the ring's
size; the ring waits only for allocations the writer frees by itself."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.export.session.host import HostRing

WAIT_S = 20.0  # the last resort, set long: an export that waits for it fails the time bound below


def _model():
    import paddle

    class Model(paddle.nn.Layer):  # streamed zz, big, aa; written aa, big, zz (file order is by name)
        def __init__(self):
            super().__init__()
            self.zz = paddle.nn.Linear(64, 64)
            self.big = paddle.nn.Linear(256, 512)  # a 512 KiB weight
            self.aa = paddle.nn.Linear(64, 64)

    paddle.seed(3)
    return Model()


def _export(out: Path, overrides) -> dict:
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession, ModelSource

    layer = _model()
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=5GB", "on_error=raise", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    source = ModelSource(sharded_state_dict=layer.sharded_state_dict,
                         hf_config={"architectures": ["Toy"], "model_type": "toy"})
    session.prepare(source)
    ring = session._ring
    if ring is not None:
        ring.wait_s = WAIT_S
    t = time.perf_counter()
    session.export(source, 1, reason="test")
    session.wait_pending()
    seconds = time.perf_counter() - t
    session.close()
    files = {f.name: f.read_bytes() for f in sorted((out / "hf-step-000001").glob("*.safetensors"))}
    return {"files": files, "seconds": seconds, "ring": ring}


@pytest.fixture(scope="module")
def sync_files(tmp_path_factory):
    got = _export(tmp_path_factory.mktemp("sync"), ["export.async_write=false", "export.max_pending_bytes=530KB"])
    assert got["ring"] is None and got["seconds"] < WAIT_S / 2
    return got["files"]


@pytest.mark.parametrize("ring", ["1B", "100KB", "530KB", "600KB", "2MB"])
def test_a_capped_ring_never_waits_and_writes_the_sync_bytes(ring, sync_files, tmp_path):
    got = _export(tmp_path, ["export.async_write=true", f"export.max_pending_bytes={ring}"])
    assert got["files"] == sync_files
    assert got["ring"] is not None and got["ring"].timeouts == 0
    assert got["seconds"] < WAIT_S / 2, got["seconds"]
    if ring == "530KB":  # the case: 16.6 KB parked at the ring's front, a 512 KiB tensor > half of it
        assert got["ring"].size == 530_000 and 512 * 1024 > got["ring"].size // 2


def test_alloc_waits_only_for_what_will_be_freed():
    ring = HostRing(100, wait_s=WAIT_S)
    _, parked = ring.alloc(60, key="parked")
    t = time.perf_counter()
    assert ring.alloc(50, key="x", may_wait=lambda tok: tok[3] != "parked") == (None, None)  # at once
    assert time.perf_counter() - t < 1.0 and ring.timeouts == 0
    got = {}

    def later():
        got["view"] = ring.alloc(50, may_wait=lambda tok: True)[0]

    th = threading.Thread(target=later)
    th.start()
    th.join(0.2)
    assert th.is_alive()  # the writer will free it: back pressure
    ring.free(parked)
    th.join(5)
    assert got["view"] is not None and got["view"].nbytes == 50 and ring.timeouts == 0


def test_ring_arrays_are_labelled_for_may_wait():
    ring = HostRing(1000)
    a = ring.array((10,), np.float32)
    ring.label(a.T, "w")
    seen = []
    ring.alloc(990, may_wait=lambda tok: seen.append(tok[3]) or False)
    assert seen == ["w"]


def test_the_writer_says_which_tensors_it_writes_without_more(tmp_path):
    from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter
    from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

    plan = build_export_plan([TensorSpec(n, (4,), "float32") for n in ("a", "b", "c")], max_shard_size=10**6)
    w = SnapshotWriter(plan, tmp_path, background=False)
    assert not w.will_write("b")
    w.put("b", np.ones(4, np.float32))
    assert not w.will_write("b")  # "a" comes first in the file and is not handed over
    w.put("a", np.ones(4, np.float32))
    assert w.will_write("a") and w.will_write("b") and not w.will_write("c")
    w.put("c", np.ones(4, np.float32))
    w.close()
