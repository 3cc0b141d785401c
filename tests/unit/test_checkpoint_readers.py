"""The checkpoint readers of ``convert`` on files made here byte for byte as the trainers make them
(``pickle.dump(..., protocol=4)`` of numpy arrays is what ``paddle.save`` writes; Paddle's own
metadata classes for flex checkpoints; the safetensors library), without a trainer: offsets, reads
across blocks, views and copies, and every kind of damage named."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.convert.checkpoints import Checkpoint, CheckpointError, FileSlice, TensorInfo, open_checkpoint
from paddle_fullparam_callbacks.convert.checkpoints._base import check_tiling
from paddle_fullparam_callbacks.convert.checkpoints._pickles import PickleFormatError, index_tensor_pickle

RNG = np.random.default_rng(0)


def _save(path: Path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)  # paddle.save's format for a dict of numpy arrays


# ---- paddle.save pickles --------------------------------------------------------------------------

def test_array_offsets_are_found_inside_and_outside_pickle_frames(tmp_path):
    arrays = {"small": RNG.standard_normal((3, 4)).astype("float32"),          # inside a 64 KiB frame
              "large": RNG.standard_normal((300, 200)).astype("float32"),      # written outside frames
              "bf16": RNG.integers(0, 2**16, (5, 7), dtype=np.uint16),
              "fortran": np.asfortranarray(RNG.standard_normal((6, 5)).astype("float32"))}
    f = tmp_path / "model_state.pdparams"
    _save(f, {**arrays, "StructuredToParameterName@@": {"small": "p_0"}})
    refs = index_tensor_pickle(f)
    raw = f.read_bytes()
    for k, a in arrays.items():
        r = refs[k]
        assert (r.shape, r.dtype, r.fortran) == (a.shape, a.dtype, k == "fortran")
        got = np.frombuffer(raw[r.offset:r.offset + r.nbytes], a.dtype).reshape(a.shape, order="F" if r.fortran else "C")
        assert np.array_equal(got, a)


@pytest.mark.parametrize("payload,why", [
    (lambda: __import__("os").system, "refusing global"),
    (lambda: [1, 2], "not a dict of tensors"),
])
def test_a_pickle_that_is_not_a_dict_of_arrays_is_refused(tmp_path, payload, why):
    f = tmp_path / "x.pdparams"
    _save(f, payload())
    with pytest.raises(PickleFormatError, match=why):
        index_tensor_pickle(f)


def test_a_truncated_pickle_is_refused_naming_the_cause(tmp_path):
    f = tmp_path / "x.pdparams"
    _save(f, {"w": np.zeros((400, 400), np.float32)})
    f.write_bytes(f.read_bytes()[:-5000])
    with pytest.raises(PickleFormatError, match="truncated"):
        index_tensor_pickle(f)


def _pdparams_checkpoint(tmp_path, arrays, config=None) -> Path:
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    _save(ckpt / "model_state.pdparams", arrays)
    (ckpt / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"],
                                                            "paddlenlp_version": "2.8.1"}))
    return ckpt


def test_a_one_process_pdparams_checkpoint_reads_back_views_and_copies(tmp_path):
    w = RNG.standard_normal((64, 48)).astype("float32")
    ckpt = open_checkpoint(_pdparams_checkpoint(tmp_path, {"a.weight": w, "a.bias": w[0].copy()}))
    assert (ckpt.framework, ckpt.layout, ckpt.step) == ("paddlenlp", "pdparams", 7)
    assert ckpt.tensors["a.weight"].global_shape == (64, 48) and ckpt.tensors["a.weight"].dtype == "float32"
    view = ckpt.read("a.weight", (8, 4), (10, 20))
    assert np.array_equal(view, w[8:18, 4:24]) and not view.flags.writeable
    copy = ckpt.read("a.weight", (0, 0), (64, 48), copy=True)
    assert np.array_equal(copy, w) and copy.flags.writeable and copy.flags.owndata
    with pytest.raises(CheckpointError, match=r"region \[60, 0\]\+\[10, 48\] is outside it"):
        ckpt.read("a.weight", (60, 0), (10, 48))


def test_bfloat16_stored_as_uint16_needs_the_config_to_say_so(tmp_path):
    bits = RNG.integers(0, 2**16, (4, 4), dtype=np.uint16)
    path = _pdparams_checkpoint(tmp_path, {"w": bits})
    with pytest.raises(CheckpointError, match="stored as uint16 .* config.json says the model dtype is nothing"):
        open_checkpoint(path)
    (path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "paddlenlp_version": "2.8.1"}))
    ckpt = open_checkpoint(path)
    assert ckpt.tensors["w"].dtype == "bfloat16" and np.array_equal(ckpt.read("w", (0, 0), (4, 4)), bits)


# ---- reads across blocks ---------------------------------------------------------------------------

def _blocks_checkpoint(tmp_path, full: np.ndarray, cuts) -> Checkpoint:
    """``full`` cut into blocks (one file each), indexed by hand as the readers index files."""
    slices = []
    for i, (r0, r1, c0, c1) in enumerate(cuts):
        f = tmp_path / f"{i}.bin"
        block = np.ascontiguousarray(full[r0:r1, c0:c1])
        f.write_bytes(b"junk" * i + block.tobytes())
        slices.append(FileSlice(f, (r0, c0), block.shape, "float32", 4 * i))
    info = TensorInfo(full.shape, "float32", slices)
    check_tiling("w", info)
    return Checkpoint(tmp_path, "paddleformers", "flex", {"w": info}, None, {}, 1, [])


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("region", [((0, 0), (12, 10)), ((3, 2), (7, 7)), ((6, 0), (6, 10)), ((5, 4), (1, 1))])
def test_a_region_across_blocks_is_stitched_from_every_block_it_touches(tmp_path, region, copy):
    full = RNG.standard_normal((12, 10)).astype("float32")
    ckpt = _blocks_checkpoint(tmp_path, full, [(0, 6, 0, 5), (0, 6, 5, 10), (6, 12, 0, 10)])
    (o0, o1), (n0, n1) = region
    assert np.array_equal(ckpt.read("w", region[0], region[1], copy=copy), full[o0:o0 + n0, o1:o1 + n1])


def test_a_block_cut_short_after_indexing_is_named(tmp_path):
    full = RNG.standard_normal((12, 10)).astype("float32")
    ckpt = _blocks_checkpoint(tmp_path, full, [(0, 6, 0, 10), (6, 12, 0, 10)])
    f = tmp_path / "1.bin"
    f.write_bytes(f.read_bytes()[:100])
    for copy in (False, True):
        with pytest.raises(CheckpointError, match="1.bin: the block .* (ends at byte|the file ended)"):
            ckpt.read("w", (0, 0), (12, 10), copy=copy)


@pytest.mark.parametrize("cuts,why", [
    ([(0, 6, 0, 10)], r"no slice covers the block at \[6, 0\] \(a gap"),
    ([(0, 7, 0, 10), (6, 12, 0, 10)], "slices overlap"),
])
def test_blocks_that_do_not_tile_the_tensor_are_refused(tmp_path, cuts, why):
    full = RNG.standard_normal((12, 10)).astype("float32")
    with pytest.raises(CheckpointError, match=why):
        _blocks_checkpoint(tmp_path, full, cuts)


# ---- PaddleFormers flex checkpoints (Paddle's own metadata classes) --------------------------------

def _flex_checkpoint(tmp_path, full: np.ndarray, *, replicas=False, drop_file=False, wrong_dtype=False):
    from paddle.distributed.flex_checkpoint.dcp.metadata import LocalTensorIndex, LocalTensorMetadata, Metadata

    ckpt = tmp_path / "checkpoint-3"
    state = ckpt / "model_state"
    state.mkdir(parents=True)
    half = full.shape[1] // 2
    norm = RNG.standard_normal(full.shape[0]).astype("float32")
    files = {"0_0.distcp": {"w": np.ascontiguousarray(full[:, :half]), "norm": norm},
             "1_0.distcp": {"w": np.ascontiguousarray(full[:, half:]).astype("float64" if wrong_dtype else "float32")}}
    if replicas:
        files["1_0.distcp"]["norm"] = norm
    meta_w = [LocalTensorMetadata((0, 0), (full.shape[0], half), "float32", full.shape),
              LocalTensorMetadata((0, half), (full.shape[0], half), "float32", full.shape)]
    storage = {LocalTensorIndex("w", (0, 0), local_shape=(full.shape[0], half)): "0_0.distcp",
               LocalTensorIndex("w", (0, half), local_shape=(full.shape[0], half)): "1_0.distcp",
               LocalTensorIndex("norm", (0,), replica_id=0 if replicas else None): "0_0.distcp"}
    if replicas:
        storage[LocalTensorIndex("norm", (0,), replica_id=1)] = "1_0.distcp"
    meta = Metadata({"w": meta_w, "norm": [LocalTensorMetadata((0,), norm.shape, "float32", norm.shape)]}, storage, {})
    with open(state / "0.metadata", "wb") as f:
        pickle.dump(meta, f, protocol=4)
    for name, arrays in files.items():
        if not (drop_file and name == "1_0.distcp"):
            _save(state / name, arrays)
    return ckpt, norm


@pytest.mark.parametrize("replicas", [False, True])
def test_a_flex_checkpoint_is_read_from_its_metadata_and_rank_files(tmp_path, replicas):
    full = RNG.standard_normal((8, 6)).astype("float32")
    path, norm = _flex_checkpoint(tmp_path, full, replicas=replicas)
    ckpt = open_checkpoint(path, config={"architectures": ["LlamaForCausalLM"]})
    assert (ckpt.framework, ckpt.layout, ckpt.step) == ("paddleformers", "flex", 3)
    assert [s.file.name for s in ckpt.tensors["norm"].slices] == ["0_0.distcp"]  # replica 0 only
    assert np.array_equal(ckpt.read("w", (0, 0), (8, 6)), full)
    assert np.array_equal(ckpt.read("w", (2, 1), (3, 4), copy=True), full[2:5, 1:5])
    assert np.array_equal(ckpt.read("norm", (0,), (8,)), norm)


@pytest.mark.parametrize("damage,why", [
    ({"drop_file": True}, r"model_state/1_0\.distcp is missing: model_state/0\.metadata says it holds slices"),
    ({"wrong_dtype": True}, r"1_0\.distcp: tensor 'w' is float64 \[8, 3\], but model_state/0\.metadata says float32"),
])
def test_a_flex_checkpoint_that_contradicts_its_metadata_is_refused(tmp_path, damage, why):
    path, _ = _flex_checkpoint(tmp_path, RNG.standard_normal((8, 6)).astype("float32"), **damage)
    with pytest.raises(CheckpointError, match=why):
        open_checkpoint(path)


def test_a_directory_that_is_no_checkpoint_says_what_was_expected(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a trainer checkpoint: expected model_state/"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(tmp_path / "missing")


def test_a_truncated_safetensors_shard_is_refused(tmp_path):
    from safetensors.numpy import save_file

    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    save_file({"a": np.ones((64, 64), np.float32)}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"paddlenlp_version": "2.8.1"}))
    assert open_checkpoint(ckpt).layout == "unified-safetensors"
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .a. runs past the end of the file \(.*truncated\?\)"):
        open_checkpoint(ckpt)
