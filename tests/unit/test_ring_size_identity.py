"""Bit identity of async exports whatever the ring's size: a ring that holds the rank's bytes (auto),
one the node's memory caps (the rest is copied outside it) and an explicit small one all write the
bytes the synchronous export writes, also when training changes the weights while the bytes are
still going to disk (the second export reuses the ring)."""
from __future__ import annotations

from pathlib import Path

import pytest

from paddle_fullparam_callbacks.export.session import ring_size as rs

STEPS = (1, 2)


def _export(out: Path, overrides) -> dict:
    import paddle

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession, ModelSource

    paddle.seed(0)
    layer = paddle.nn.Sequential(paddle.nn.Linear(64, 256), paddle.nn.Linear(256, 64), paddle.nn.LayerNorm(64))
    cfg = load_config(None, [f"output_dir={out}", "export.max_shard_size=40KB", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    source = ModelSource(sharded_state_dict=layer.sharded_state_dict,
                         hf_config={"architectures": ["Toy"], "model_type": "toy"})
    session.prepare(source)
    ring = session._ring.size if session._ring is not None else None
    for step in STEPS:
        with paddle.no_grad():
            for i, p in enumerate(layer.parameters()):
                p.set_value(paddle.randn(p.shape, p.dtype) * (step + i))
        session.export(source, step, reason="test")
        with paddle.no_grad():  # "training" overwrites the weights while a background export writes
            for p in layer.parameters():
                p.set_value(paddle.full(p.shape, -1.0, p.dtype))
    session.wait_pending()
    session.close()
    files = {f"{s}/{f.name}": f.read_bytes() for s in STEPS
             for f in sorted((out / f"hf-step-{s:06d}").glob("*.safetensors"))}
    return {"ring": ring, "files": files}


@pytest.fixture(scope="module")
def sync_files(tmp_path_factory):
    got = _export(tmp_path_factory.mktemp("sync"), ["export.async_write=false"])
    assert got["ring"] is None and len(got["files"]) >= 4
    return got["files"]


@pytest.mark.parametrize("case", ["auto", "auto-capped", "explicit-small"])
def test_async_bytes_equal_sync_bytes(case, sync_files, tmp_path, monkeypatch):
    rank_bytes = sum(len(b) for b in sync_files.values()) // len(STEPS)  # headers included: an upper bound
    overrides = ["export.async_write=true"]
    if case == "auto":
        monkeypatch.setattr(rs, "read_meminfo", lambda: f"MemAvailable: {64 * 2**20} kB\n")
    elif case == "auto-capped":  # a cap of 100 KiB: most tensors do not fit and are copied outside the ring
        monkeypatch.setattr(rs, "read_meminfo", lambda: f"MemAvailable: {400} kB\n")
        monkeypatch.setenv("PADDLE_LOCAL_SIZE", "2")
    else:
        overrides.append("export.max_pending_bytes=48KB")
    got = _export(tmp_path, overrides)
    expected_ring = {"auto": None, "auto-capped": 400 * 1024 // 4, "explicit-small": 48_000}[case]
    if expected_ring is None:
        assert 0 < got["ring"] <= rank_bytes  # the rank's data bytes, all of them
    else:
        assert got["ring"] == expected_ring
    assert got["files"].keys() == sync_files.keys()
    for name, data in sync_files.items():
        assert got["files"][name] == data, name
