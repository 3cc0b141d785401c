"""The streaming safetensors writer and the bounds-checked header reader."""
from __future__ import annotations

import json
import os
import random
import re
import threading

import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file

from paddle_fullparam_callbacks.export.write import checksum, writer
from paddle_fullparam_callbacks.export.write.header import SafetensorsFormatError, read_header, read_tensor
from paddle_fullparam_callbacks.export.write.writer import FileResult, SnapshotWriter
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

STORAGE = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bfloat16": np.uint16}


def make_arrays(specs, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for t in specs:
        dt = STORAGE[t.dtype]
        if np.issubdtype(dt, np.floating):
            a = rng.standard_normal(t.shape).astype(dt)
        else:
            a = rng.integers(-(2**40), 2**40, size=t.shape).astype(dt) if dt == np.int64 else rng.integers(
                0, 2**16, size=t.shape
            ).astype(dt)
        out[t.name] = a
    return out


MIXED_SPECS = [
    TensorSpec("emb.weight", (16, 8), "float32"),
    TensorSpec("layers.0.w", (8, 8), "float16"),
    TensorSpec("layers.0.b", (8,), "float32"),
    TensorSpec("layers.0.idx", (5,), "int64"),
    TensorSpec("layers.1.w", (8, 8), "float16"),
    TensorSpec("layers.1.b", (8,), "float32"),
    TensorSpec("layers.1.idx", (3, 2), "int64"),
    TensorSpec("layers.2.empty", (0,), "float32"),
    TensorSpec("layers.10.w", (4, 4, 2), "float32"),
    TensorSpec("scalar", (), "int64"),
    TensorSpec("norm.weight", (7,), "float16"),
]


def put_order(plan, how, seed=1):
    in_file_order = [s.name for f in plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
    if how == "file":
        return in_file_order
    if how == "reverse":
        return in_file_order[::-1]
    names = list(in_file_order)
    random.Random(seed).shuffle(names)
    return names


def write_all(plan, directory, arrays, order, **kw):
    w = SnapshotWriter(plan, directory, **kw)
    for name in order:
        w.put(name, arrays[name])
    return w, w.close()


def check_results(plan, directory, results):
    assert set(results) == {f.name for f in plan.files}
    for f in plan.files:
        path = directory / f.name
        r = results[f.name]
        assert isinstance(r, FileResult) and r.name == f.name
        assert r.bytes == path.stat().st_size == f.total_bytes
        assert r.digest == checksum.new(checksum.DEFAULT, path.read_bytes()).hexdigest()
        assert checksum.digest_of_file(path) == r.digest


# ---- round trip -------------------------------------------------------------------------------
@pytest.mark.parametrize("max_pending", [1 << 20, 1], ids=["large-budget", "tiny-budget"])
@pytest.mark.parametrize("background", [True, False], ids=["bg", "fg"])
@pytest.mark.parametrize("order", ["file", "reverse", "shuffled"])
def test_round_trip_through_official_loader(tmp_path, order, background, max_pending):
    plan = build_export_plan(MIXED_SPECS, 300)
    assert len(plan.files) >= 3  # several files, several tensors in some of them
    assert any(len(f.slots) > 1 for f in plan.files)
    arrays = make_arrays(MIXED_SPECS)
    _, results = write_all(
        plan, tmp_path, arrays, put_order(plan, order), background=background, max_pending_bytes=max_pending
    )
    check_results(plan, tmp_path, results)
    assert sorted(os.listdir(tmp_path)) == sorted(f.name for f in plan.files)

    loaded = {}
    for f in plan.files:
        part = load_file(str(tmp_path / f.name))
        assert set(part) == {s.name for s in f.slots}
        loaded.update(part)
        metadata, entries, data_start = read_header(tmp_path / f.name)
        assert metadata == {"format": "pt"}
        assert data_start == len(f.header)
        assert {n: (e.begin, e.end) for n, e in entries.items()} == {s.name: (s.begin, s.end) for s in f.slots}
    assert set(loaded) == set(arrays)
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype, name
        assert loaded[name].shape == a.shape, name
        assert loaded[name].tobytes() == a.tobytes(), name
        assert read_tensor(tmp_path / plan.files[plan.slots[name].file_index].name, name).tobytes() == a.tobytes()


STRIDED_VIEWS = {
    "transpose-2d": lambda: np.arange(60, dtype=np.float32).reshape(6, 10).T,
    "step-1d": lambda: np.arange(40, dtype=np.int64)[::3],
    "transpose-3d": lambda: np.arange(120, dtype=np.float16).reshape(4, 5, 6).transpose(2, 0, 1),
    "column-slice": lambda: np.arange(96, dtype=np.float32).reshape(8, 12)[:, ::4],
}


@pytest.mark.parametrize("block_bytes", [8 * 2**20, 16], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("order", ["file", "reverse"])
@pytest.mark.parametrize("background", [True, False], ids=["bg", "fg"])
def test_strided_views_are_written_in_c_order(tmp_path, monkeypatch, background, order, block_bytes):
    monkeypatch.setattr(writer, "_BLOCK_BYTES", block_bytes)
    arrays = {name: make() for name, make in STRIDED_VIEWS.items()}
    assert not any(a.flags.c_contiguous for a in arrays.values())
    dtype_of = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.float16): "float16"}
    specs = [TensorSpec(n, a.shape, dtype_of[a.dtype]) for n, a in arrays.items()]
    plan = build_export_plan(specs, 10**6)  # one file: exercises in-order hashing and the stash
    _, results = write_all(plan, tmp_path, arrays, put_order(plan, order), background=background)
    check_results(plan, tmp_path, results)
    loaded = load_file(str(tmp_path / plan.files[0].name))
    for name, a in arrays.items():
        assert loaded[name].tobytes() == np.ascontiguousarray(a).tobytes(), name


# ---- bfloat16 ---------------------------------------------------------------------------------
def test_bfloat16_written_from_uint16_bits(tmp_path):
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    bits = np.array([[0x3F80, 0x4000, 0xC040], [0x0000, 0x8000, 0x7F80]], dtype=np.uint16)  # 1, 2, -3, 0, -0, inf
    plan = build_export_plan([TensorSpec("x", (2, 3), "bfloat16"), TensorSpec("y", (2,), "float32")], 1000)
    w = SnapshotWriter(plan, tmp_path)
    with pytest.raises(ValueError, match=r"'x'.*storage uint16"):
        w.put("x", bits.view(np.float16))  # bfloat16 slots take uint16 storage only
    w.put("x", bits)
    w.put("y", np.array([1.5, -2.0], np.float32))
    w.close()
    path = tmp_path / plan.files[0].name

    _, entries, start = read_header(path)
    assert entries["x"].dtype == "BF16" and entries["x"].shape == (2, 3)
    assert json.loads(path.read_bytes()[8:start])["x"]["dtype"] == "BF16"
    raw = path.read_bytes()[start + entries["x"].begin : start + entries["x"].end]
    assert raw == bits.astype("<u2").tobytes()
    np.testing.assert_array_equal(read_tensor(path, "x"), bits)
    as_f32 = (read_tensor(path, "x").astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(as_f32, np.array([[1, 2, -3], [0, -0.0, np.inf]], np.float32))

    # the official library accepts the file (it validates the header on open)
    with safetensors.safe_open(str(path), framework="numpy") as g:
        assert set(g.keys()) == {"x", "y"}
        np.testing.assert_array_equal(g.get_tensor("y"), np.array([1.5, -2.0], np.float32))
    if have_torch:  # pragma: no cover - torch is not in this environment
        import torch
        from safetensors.torch import load_file as load_torch

        t = load_torch(str(path))["x"]
        assert t.dtype == torch.bfloat16
        assert t.view(torch.int16).numpy().view(np.uint16).tolist() == bits.tolist()


# ---- file subsets -----------------------------------------------------------------------------
@pytest.mark.parametrize("background", [True, False])
def test_file_indices_subset(tmp_path, background):
    specs = [TensorSpec(f"t{i}", (4,), "float32") for i in range(4)]
    plan = build_export_plan(specs, 16)  # one tensor per file
    assert len(plan.files) == 4
    arrays = make_arrays(specs)
    w = SnapshotWriter(plan, tmp_path, file_indices=[2, 0], background=background)
    assert w.wants("t0") and w.wants("t2") and not w.wants("t1") and not w.wants("nope")
    with pytest.raises(KeyError, match=r"'t1'.*model-00002-of-00004"):
        w.put("t1", arrays["t1"])
    with pytest.raises(KeyError, match=r"'nope' is not in the export plan"):
        w.put("nope", arrays["t1"])
    w.put("t0", arrays["t0"])
    w.put("t2", arrays["t2"])
    results = w.close()
    wanted = {plan.files[0].name, plan.files[2].name}
    assert set(results) == wanted
    assert set(os.listdir(tmp_path)) == wanted
    assert load_file(str(tmp_path / plan.files[2].name))["t2"].tobytes() == arrays["t2"].tobytes()


# ---- misuse -----------------------------------------------------------------------------------
@pytest.mark.parametrize("background", [True, False])
def test_put_rejects_wrong_dtype_shape_and_duplicates(tmp_path, background):
    plan = build_export_plan([TensorSpec("a.w", (2, 3), "float32"), TensorSpec("b.w", (4,), "int64")], 1000)
    w = SnapshotWriter(plan, tmp_path, background=background)
    with pytest.raises(ValueError, match=r"tensor 'a\.w': got float64\[2, 3\]"):
        w.put("a.w", np.zeros((2, 3), np.float64))
    with pytest.raises(ValueError, match=r"tensor 'a\.w': got float32\[3, 2\]"):
        w.put("a.w", np.zeros((3, 2), np.float32))
    good = np.arange(6, dtype=np.float32).reshape(2, 3)
    w.put("a.w", good)  # a rejected put does not count as received
    with pytest.raises(ValueError, match=r"tensor 'a\.w' was handed to the writer twice"):
        w.put("a.w", good)
    w.put("b.w", np.arange(4, dtype=np.int64))
    w.close()
    got = load_file(str(tmp_path / plan.files[0].name))
    np.testing.assert_array_equal(got["a.w"], good)


@pytest.mark.parametrize("background", [True, False])
def test_close_with_missing_tensor_raises_and_removes_files(tmp_path, background):
    specs = [TensorSpec(f"t{i}", (4,), "float32") for i in range(3)] + [TensorSpec("lost.w", (2,), "float32")]
    plan = build_export_plan(specs, 32)
    arrays = make_arrays(specs)
    w = SnapshotWriter(plan, tmp_path, background=background)
    for name in ("t0", "t1", "t2"):
        w.put(name, arrays[name])
    with pytest.raises(RuntimeError, match=r"no data for tensor\(s\) \['lost\.w'\]"):
        w.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("background", [True, False])
def test_abort_removes_files(tmp_path, background):
    specs = [TensorSpec(f"t{i}", (64,), "float32") for i in range(6)]
    plan = build_export_plan(specs, 600)
    arrays = make_arrays(specs)
    w = SnapshotWriter(plan, tmp_path, background=background)
    for name in ("t0", "t1", "t5"):
        w.put(name, arrays[name])
    if not background:
        assert os.listdir(tmp_path) != []  # the files exist before abort
    w.abort()
    assert os.listdir(tmp_path) == []


def test_abort_before_any_put(tmp_path):
    plan = build_export_plan([TensorSpec("t", (4,), "float32")], 100)
    (tmp_path / "other.txt").write_text("keep me")
    SnapshotWriter(plan, tmp_path).abort()
    assert os.listdir(tmp_path) == ["other.txt"]


# ---- memory bound -----------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["file", "reverse", "shuffled"])
def test_pending_bytes_stay_within_budget(tmp_path, order):
    budget = 4096
    specs = [TensorSpec(f"layers.{i}.w", (200,), "float32") for i in range(120)]  # 800 B < budget / 4
    plan = build_export_plan(specs, 8000)
    arrays = make_arrays(specs)
    w, results = write_all(plan, tmp_path, arrays, put_order(plan, order, seed=7), max_pending_bytes=budget)
    assert 800 <= w.peak_pending_bytes <= budget
    check_results(plan, tmp_path, results)
    loaded = {}
    for f in plan.files:
        loaded.update(load_file(str(tmp_path / f.name)))
    assert all(loaded[n].tobytes() == a.tobytes() for n, a in arrays.items())


def test_tensor_larger_than_budget_goes_through_alone(tmp_path):
    specs = [TensorSpec("big", (1000,), "float32"), TensorSpec("small", (4,), "float32")]
    plan = build_export_plan(specs, 10**6)
    arrays = make_arrays(specs)
    box = {}

    def run():
        box["results"] = write_all(plan, tmp_path, arrays, ["small", "big"], max_pending_bytes=64)[1]

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "writer deadlocked on a tensor larger than max_pending_bytes"
    check_results(plan, tmp_path, box["results"])
    assert load_file(str(tmp_path / plan.files[0].name))["big"].tobytes() == arrays["big"].tobytes()


# ---- damaged files ----------------------------------------------------------------------------
DAMAGED = "damaged-file.safetensors"


@pytest.fixture
def good_file(tmp_path):
    """A valid file with a: F32 [2,2] at [0,16) and b: F16 [3] at [16,22), renamed to DAMAGED."""
    plan = build_export_plan([TensorSpec("a", (2, 2), "float32"), TensorSpec("b", (3,), "float16")], 1000)
    arrays = {"a": np.arange(4, dtype=np.float32).reshape(2, 2), "b": np.ones(3, np.float16)}
    write_all(plan, tmp_path, arrays, ["a", "b"], background=False)
    path = tmp_path / DAMAGED
    os.replace(tmp_path / plan.files[0].name, path)
    read_header(path)  # control: the undamaged file passes
    assert set(load_file(str(path))) == {"a", "b"}
    return path


def split(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite(path, header, data):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * ((-len(text)) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def _truncate_data(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])


def _truncate_header(path):
    path.write_bytes(path.read_bytes()[:5])


def _length_past_end(path):
    raw = path.read_bytes()
    path.write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])


def _invalid_json(path):
    h, d = split(path)
    rewrite(path, json.dumps(h).encode()[:-1] + b",}", d)


def _not_an_object(path):
    rewrite(path, b"[1, 2]", split(path)[1])


def _edit(fn):
    def damage(path):
        h, d = split(path)
        d = fn(h, d)
        rewrite(path, h, d)

    return damage


def _overlap(h, d):
    h["b"]["data_offsets"] = [12, 18]
    return d


def _gap(h, d):
    h["b"]["data_offsets"] = [20, 26]
    return d + b"\0" * 4


def _trailing(h, d):
    return d + b"\0" * 5


def _span(h, d):
    h["b"]["shape"] = [4]
    return d


def _dtype(h, d):
    h["b"]["dtype"] = "F33"
    return d


def _bad_shape(h, d):
    h["a"]["shape"] = [2, -2]
    return d


def _missing_field(h, d):
    del h["a"]["data_offsets"]
    return d


@pytest.mark.parametrize(
    "damage, match",
    [
        (_truncate_data, r"tensor 'b' runs past the end of the file .*truncated"),
        (_truncate_header, r"file is 5 bytes, too short for a header"),
        (_length_past_end, r"header length \d+ runs past the file"),
        (_invalid_json, r"header is not valid JSON"),
        (_not_an_object, r"header is not a JSON object"),
        (_edit(_overlap), r"tensor 'b' overlaps the tensor before it"),
        (_edit(_gap), r"a gap of 4 bytes lies before tensor 'b'"),
        (_edit(_trailing), r"5 trailing bytes after the last tensor"),
        (_edit(_span), r"tensor 'b' spans 6 bytes, its shape \[4\] of F16 needs 8"),
        (_edit(_dtype), r"tensor 'b' has unknown dtype 'F33'"),
        (_edit(_bad_shape), r"tensor 'a' has invalid shape \[2, -2\]"),
        (_edit(_missing_field), r"tensor 'a' has a malformed header entry"),
    ],
    ids=[
        "truncated-data", "truncated-header", "length-past-end", "invalid-json", "not-an-object", "overlap",
        "gap", "trailing", "span-mismatch", "unknown-dtype", "negative-dim", "missing-field",
    ],
)
def test_read_header_rejects_damaged_file(good_file, damage, match):
    damage(good_file)
    with pytest.raises(SafetensorsFormatError, match=re.escape(DAMAGED) + ": " + match) as info:
        read_header(good_file)
    assert isinstance(info.value, ValueError)
    with pytest.raises(SafetensorsFormatError):
        read_tensor(good_file, "a")


# ---- regressions of bugs found and fixed -----------------------------------------------------
def test_zero_size_multidim_tensor_round_trips(tmp_path):
    plan = build_export_plan([TensorSpec("e", (0, 4), "float32"), TensorSpec("w", (2,), "float32")], 1000)
    w = SnapshotWriter(plan, tmp_path, background=False)
    w.put("e", np.zeros((0, 4), np.float32))  # TypeError: memoryview: cannot cast view with zeros in shape
    w.put("w", np.ones(2, np.float32))
    w.close()
    assert load_file(str(tmp_path / plan.files[0].name))["e"].shape == (0, 4)
