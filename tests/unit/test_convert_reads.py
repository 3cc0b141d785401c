"""``checkpoints.region``: a checkpoint tensor's region read where it is filled, for every format convert
reads (paddle.save pickles with C and Fortran arrays, safetensors, flex rank files, hand-cut blocks side
by side and stacked, LoRA pickles), by both of its paths (``preadv`` into the destination; a populated
mapping for transposes, Fortran blocks and short runs), in the writer's row blocks, transposed and cast,
and a file cut short after indexing named in a CheckpointError."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.convert.checkpoints import (Checkpoint, CheckpointError, FileSlice, TensorInfo, open_checkpoint,
                                                            region)
from paddle_fullparam_callbacks.convert.checkpoints import _reads
from paddle_fullparam_callbacks.convert.checkpoints._base import check_tiling
from paddle_fullparam_callbacks.host.copy import row_blocks
from paddle_fullparam_callbacks.host.lazy import CastArray
from paddle_fullparam_callbacks.host.casts import cast_into

RNG = np.random.default_rng(7)


def _save(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)  # paddle.save's format for a dict of numpy arrays


def _blocks(tmp_path, full: np.ndarray, cuts, fortran=()) -> Checkpoint:
    """``full`` [rows, cols] cut into blocks ``(r0, r1, c0, c1)``, one file each after a few junk bytes;
    the blocks listed in ``fortran`` stored in Fortran order."""
    slices = []
    for i, (r0, r1, c0, c1) in enumerate(cuts):
        block = full[r0:r1, c0:c1]
        order = "F" if i in fortran else "C"
        f = tmp_path / f"{i}.bin"
        f.write_bytes(b"junk" * i + block.tobytes(order=order))
        slices.append(FileSlice(f, (r0, c0), block.shape, full.dtype.name, 4 * i, i in fortran))
    info = TensorInfo(full.shape, full.dtype.name, slices)
    check_tiling("w", info)
    return Checkpoint(tmp_path, "paddleformers", "flex", {"w": info}, None, {}, 1, [])


def _by_writer_blocks(lazy, block_bytes: int) -> np.ndarray:
    """What the writer does with a lazy array: fill each row block into a buffer of its own."""
    out = np.full(lazy.shape, -1, lazy.dtype) if lazy.dtype.kind == "f" else np.zeros(lazy.shape, lazy.dtype)
    for r0, r1 in row_blocks(lazy, block_bytes):
        buf = np.empty((r1 - r0,) + tuple(lazy.shape[1:]), lazy.dtype)
        lazy.rows(r0, r1).fill(buf)
        out[r0:r1] = buf
    return out


def _check_all_ways(lazy, want: np.ndarray) -> None:
    assert lazy.shape == want.shape and lazy.dtype == want.dtype
    assert np.array_equal(np.asarray(lazy), want)
    assert np.array_equal(lazy.materialize(), want)
    for one, values in ((lazy, want), (lazy.T, want.T)):
        for block in (64, 1000, 1 << 20):
            assert np.array_equal(_by_writer_blocks(one, block), values)
    if want.ndim == 2 and want.shape[0] > 3:
        assert np.array_equal(lazy[1:3, ::2], want[1:3, ::2])


def _route(monkeypatch, route: str) -> None:
    """Every region through the mapping (as a transpose goes), or by preadv wherever the runs allow it."""
    if route == "mapped":
        monkeypatch.setattr(_reads._Tensor, "pread", lambda *a: False)
    else:
        monkeypatch.setattr(_reads, "_MIN_RUN_BYTES", 1)


CUTS = {
    "one block": [(0, 40, 0, 36)],
    "side by side (tensor parallel columns)": [(0, 40, 0, 18), (0, 40, 18, 36)],
    "stacked": [(0, 25, 0, 36), (25, 40, 0, 36)],
    "a grid": [(0, 25, 0, 10), (0, 25, 10, 36), (25, 40, 0, 30), (25, 40, 30, 36)],
}
REGIONS = [((0, 0), (40, 36)), ((3, 2), (30, 30)), ((25, 0), (15, 36)), ((24, 9), (2, 3)), ((5, 4), (1, 1)),
           ((7, 0), (0, 36))]


@pytest.mark.parametrize("route", ["preadv", "mapped"])
@pytest.mark.parametrize("fortran", [(), (0,)])
@pytest.mark.parametrize("cuts", list(CUTS))
def test_regions_within_and_across_blocks_read_every_way(tmp_path, monkeypatch, cuts, fortran, route):
    _route(monkeypatch, route)
    full = RNG.standard_normal((40, 36)).astype("float32")
    ckpt = _blocks(tmp_path, full, CUTS[cuts], fortran)
    for (o0, o1), (n0, n1) in REGIONS:
        _check_all_ways(region(ckpt, "w", (o0, o1), (n0, n1)), full[o0:o0 + n0, o1:o1 + n1])


def test_a_read_goes_straight_into_the_destination_without_mapping_the_file(tmp_path, monkeypatch):
    full = RNG.standard_normal((64, 4096)).astype("float32")  # 8 KB of a row in each block: worth a segment each
    ckpt = _blocks(tmp_path, full, [(0, 64, 0, 2048), (0, 64, 2048, 4096)])
    monkeypatch.setattr(_reads._Tensor, "_map", lambda self, s: pytest.fail("mapped a block"))
    lazy = region(ckpt, "w", (0, 0), (64, 4096))
    out = np.empty((10, 4096), np.float32)
    lazy.rows(20, 30).fill(out)  # rows of two blocks side by side: a preadv of one segment per row and block
    assert np.array_equal(out, full[20:30])


def test_a_transposed_region_maps_each_block_once_and_lets_it_go_once_filled(tmp_path):
    full = RNG.standard_normal((64, 48)).astype("float32")
    ckpt = _blocks(tmp_path, full, [(0, 64, 0, 48)])
    lazy = region(ckpt, "w", (0, 0), (64, 48)).T
    t = lazy._t
    out = np.empty(lazy.shape, np.float32)
    lazy.rows(0, 20).fill(out[:20])
    maps = dict(t._maps)
    assert len(maps) == 1
    lazy.rows(20, 48).fill(out[20:])
    assert np.array_equal(out, full.T) and not t._maps  # the whole region filled: unmapped


def test_casts_and_a_zero_d_tensor_on_top_of_a_region(tmp_path):
    full = RNG.standard_normal((40, 36)).astype("float32")
    ckpt = _blocks(tmp_path, full, CUTS["a grid"])
    want = np.empty((36, 40), np.uint16)
    cast_into(want, full.T, "float32", "bfloat16")
    lazy = CastArray(region(ckpt, "w", (0, 0), (40, 36)).T, "float32", "bfloat16", np.dtype(np.uint16))
    assert np.array_equal(_by_writer_blocks(lazy, 256), want)
    cast = CastArray(region(ckpt, "w", (0, 0), (40, 36)), "float32", "bfloat16", np.dtype(np.uint16)).T
    assert np.array_equal(_by_writer_blocks(cast, 256), want)

    f = tmp_path / "scalar.bin"
    f.write_bytes(b"xx" + np.float32(3.5).tobytes())
    info = TensorInfo((), "float32", [FileSlice(f, (), (), "float32", 2)])
    scalar = region(Checkpoint(tmp_path, "paddleformers", "flex", {"s": info}, None, {}, 1, []), "s", (), ())
    out = np.empty((), np.float32)
    scalar.fill(out)
    assert out == np.float32(3.5) and np.asarray(scalar) == np.float32(3.5) and scalar.rows(0, 1) is scalar


@pytest.mark.parametrize("route", ["preadv", "mapped"])
def test_a_file_cut_short_after_indexing_is_named_and_nothing_is_filled_past_it(tmp_path, monkeypatch, route):
    _route(monkeypatch, route)
    full = RNG.standard_normal((40, 36)).astype("float32")
    ckpt = _blocks(tmp_path, full, CUTS["stacked"])
    lazy = region(ckpt, "w", (0, 0), (40, 36))
    f = tmp_path / "1.bin"
    f.write_bytes(f.read_bytes()[:1000])
    out = np.empty((15, 36), np.float32)
    with pytest.raises(CheckpointError, match=r"1\.bin: the block \[25, 0\]\+\[15, 36\] in 1\.bin ends at byte 2164, "
                                              r"the file ended at \d+ \(it changed after it was indexed\?\)"):
        lazy.rows(25, 40).fill(out)
    with pytest.raises(CheckpointError, match=r"1\.bin: the block .* ends at byte 2164, the file ended"):
        lazy.T.rows(0, 4).fill(np.empty((4, 40), np.float32))
    first = np.empty((25, 36), np.float32)
    lazy.rows(0, 25).fill(first)  # the intact block still reads
    assert np.array_equal(first, full[:25])


# ---- every format convert reads ---------------------------------------------------------------------

def _pdparams(tmp_path, arrays, config=None, name="model_state.pdparams") -> Path:
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    _save(ckpt / name, arrays)
    (ckpt / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"],
                                                            "paddlenlp_version": "2.8.1"}))
    return ckpt


def _arrays():
    return {"w": RNG.standard_normal((300, 200)).astype("float32"),             # outside pickle frames
            "small": RNG.standard_normal((3, 5)).astype("float32"),             # inside a 64 KiB frame
            "fortran": np.asfortranarray(RNG.standard_normal((70, 90)).astype("float32")),
            "bias": RNG.standard_normal(200).astype("float32")}


def _check_checkpoint(ckpt: Checkpoint, arrays) -> None:
    for k, a in arrays.items():
        info = ckpt.tensors[k]
        _check_all_ways(region(ckpt, k, (0,) * a.ndim, a.shape), a)
        if a.ndim == 2:
            _check_all_ways(region(ckpt, k, (1, 2), (a.shape[0] - 2, a.shape[1] - 3)), a[1:-1, 2:-1])
        assert tuple(info.global_shape) == a.shape


def test_a_pdparams_pickle_reads_c_and_fortran_arrays(tmp_path):
    arrays = _arrays()
    _check_checkpoint(open_checkpoint(_pdparams(tmp_path, arrays)), arrays)


def test_a_lora_pickle_reads_like_the_base_weights(tmp_path):
    from paddle_fullparam_callbacks.convert.lora import lora_checkpoint

    arrays = {"llama.layers.0.self_attn.q_proj.lora_A": RNG.standard_normal((64, 8)).astype("float32"),
              "llama.layers.0.self_attn.q_proj.lora_B": RNG.standard_normal((8, 64)).astype("float32")}
    path = _pdparams(tmp_path, arrays, name="lora_model_state.pdparams")
    _check_checkpoint(lora_checkpoint(path, "paddlenlp"), arrays)


def test_a_safetensors_checkpoint_reads_its_tensors(tmp_path):
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(v) for k, v in _arrays().items()}
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    save_file(arrays, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"paddlenlp_version": "2.8.1"}))
    _check_checkpoint(open_checkpoint(ckpt), arrays)


def test_a_flex_checkpoint_reads_across_its_rank_files(tmp_path):
    from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata

    full = RNG.standard_normal((96, 80)).astype("float32")
    state = tmp_path / "checkpoint-3" / "model_state"
    state.mkdir(parents=True)
    meta = [LocalTensorMetadata((0, 0), (96, 40), "float32", full.shape),
            LocalTensorMetadata((0, 40), (96, 40), "float32", full.shape)]
    storage = {LocalTensorIndex("w", (0, 0), local_shape=(96, 40)): "0_0.distcp",
               LocalTensorIndex("w", (0, 40), local_shape=(96, 40)): "1_0.distcp"}
    with open(state / "0.metadata", "wb") as f:
        pickle.dump(Metadata({"w": meta}, storage, {}), f, protocol=4)
    _save(state / "0_0.distcp", {"w": np.ascontiguousarray(full[:, :40])})
    _save(state / "1_0.distcp", {"w": np.asfortranarray(full[:, 40:])})
    ckpt = open_checkpoint(tmp_path / "checkpoint-3", config={"architectures": ["LlamaForCausalLM"]})
    assert [s.fortran for s in ckpt.tensors["w"].slices] == [False, True]
    _check_checkpoint(ckpt, {"w": full})


def test_one_large_mapped_region_is_filled_at_a_time(tmp_path, monkeypatch):
    """The gate: a worker that starts on a second large transposed region while another one's fill is in
    flight waits for it, so that only one is mapped at a time; before it waits, it does the work it was given
    for meanwhile (the writer's hash and write stages), once."""
    import threading

    from paddle_fullparam_callbacks.host.pool import meanwhile

    monkeypatch.setattr(_reads, "GATED_BYTES", 1)
    full = RNG.standard_normal((64, 48)).astype("float32")
    ckpt = _blocks(tmp_path, full, [(0, 64, 0, 48)])
    a, b = region(ckpt, "w", (0, 0), (64, 48)).T, region(ckpt, "w", (0, 0), (64, 48)).T
    inside, release, order = threading.Event(), threading.Event(), []
    real = _reads.copy_into

    def slow_copy(dst, src):
        if not inside.is_set():
            inside.set()
            release.wait(5)
        real(dst, src)

    monkeypatch.setattr(_reads, "copy_into", slow_copy)
    out_a, out_b = np.empty(a.shape, np.float32), np.empty(b.shape, np.float32)
    ta = threading.Thread(target=lambda: (a.fill(out_a), order.append("a")))
    ta.start()
    inside.wait(5)
    helped = []

    def fill_b():
        with meanwhile(lambda: helped.append(len(order))):
            b.fill(out_b)
        order.append("b")

    tb = threading.Thread(target=fill_b)
    tb.start()
    tb.join(0.2)
    assert tb.is_alive() and not b._t._maps  # waiting at the gate, nothing of b mapped yet
    assert helped == [0]  # its meanwhile work ran, once, while a was still being filled
    release.set()
    ta.join(5)
    tb.join(5)
    assert order == ["a", "b"] and np.array_equal(out_a, full.T) and np.array_equal(out_b, full.T)
    assert not a._t._maps and not b._t._maps
