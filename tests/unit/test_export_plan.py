"""Properties of the export plan: partition, shard bound, file layout, determinism, writers."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, assign_writers, build_export_plan, natural_key

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int8": 1}
ST_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int8": "I8"}
FILE_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")

# Names look like real parameter names ("layers.10.w") so natural ordering is exercised; numbers
# are written canonically (no leading zeros; see test_plan_independent_of_order_with_leading_zeros).
_structured = st.builds(
    lambda a, i, c: f"{a}.{i}.{c}",
    st.sampled_from(["layers", "blocks", "emb", "h"]),
    st.integers(0, 120),
    st.sampled_from(["weight", "bias", "q_proj.weight", "w1"]),
)
_free = st.text(alphabet="abcxyz_.", min_size=1, max_size=8).filter(lambda s: s != "__metadata__")
names = st.one_of(_structured, _free)

spec_lists = st.lists(
    st.builds(
        TensorSpec,
        name=names,
        shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
        dtype=st.sampled_from(sorted(ITEMSIZE)),
    ),
    max_size=25,
    unique_by=lambda t: t.name,
)
shard_sizes = st.integers(1, 20000)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def nbytes(t: TensorSpec) -> int:
    n = ITEMSIZE[t.dtype]
    for d in t.shape:
        n *= d
    return n


def parse_header(header: bytes) -> dict:
    n = int.from_bytes(header[:8], "little")
    assert len(header) == 8 + n, "the length prefix must cover exactly the JSON text"
    return json.loads(header[8:].decode("ascii"))


# ---- partition and index ----------------------------------------------------------------------
@SETTINGS
@given(spec_lists, shard_sizes)
def test_every_tensor_in_exactly_one_file_and_index_matches(specs, max_shard):
    plan = build_export_plan(specs, max_shard)
    holders = {}
    for f in plan.files:
        for s in f.slots:
            assert s.name not in holders, f"{s.name} is in two files"
            holders[s.name] = f.name
            assert s.file_index == f.index
            assert plan.slots[s.name] == s
    assert set(holders) == {t.name for t in specs}
    assert plan.num_tensors == len(specs)

    index = plan.index()
    assert set(index) == {"metadata", "weight_map"}
    assert index["weight_map"] == holders
    total = sum(nbytes(t) for t in specs)
    assert index["metadata"]["total_size"] == total
    assert plan.total_tensor_bytes == total


@SETTINGS
@given(spec_lists, shard_sizes)
def test_no_file_exceeds_max_shard_size_unless_single_tensor(specs, max_shard):
    plan = build_export_plan(specs, max_shard)
    for f in plan.files:
        data = sum(s.end - s.begin for s in f.slots)
        assert f.data_bytes == data
        if data > max_shard:
            assert len(f.slots) == 1, f"{f.name}: {data} > {max_shard} bytes with {len(f.slots)} tensors"


@SETTINGS
@given(spec_lists, shard_sizes)
def test_files_are_contiguous_runs_of_natural_order_and_greedily_full(specs, max_shard):
    plan = build_export_plan(specs, max_shard)
    by_name = {t.name: t for t in specs}
    ordered = sorted(by_name, key=natural_key)
    # concatenating the files' tensors (each file in natural order) gives the global natural order
    concat = [n for f in plan.files for n in sorted((s.name for s in f.slots), key=natural_key)]
    assert concat == ordered
    # a file is closed only when the next tensor would not fit
    for f, nxt in zip(plan.files, plan.files[1:]):
        first_next = min((s.name for s in nxt.slots), key=natural_key)
        assert f.data_bytes + nbytes(by_name[first_next]) > max_shard


# ---- layout inside each file ------------------------------------------------------------------
@SETTINGS
@given(spec_lists, shard_sizes)
def test_file_layout_offsets_alignment_and_header(specs, max_shard):
    plan = build_export_plan(specs, max_shard)
    by_name = {t.name: t for t in specs}
    for f in plan.files:
        header_len = int.from_bytes(f.header[:8], "little")
        data_start = 8 + header_len
        assert data_start % 8 == 0
        assert f.total_bytes == data_start + f.data_bytes

        obj = parse_header(f.header)
        assert obj.pop("__metadata__") == {"format": "pt"}
        assert set(obj) == {s.name for s in f.slots}

        cursor = 0
        for s in sorted(f.slots, key=lambda s: (s.begin, s.end)):
            spec = by_name[s.name]
            assert s.begin == cursor, f"{s.name} starts at {s.begin}, previous ended at {cursor}"
            assert s.end - s.begin == nbytes(spec)
            assert (data_start + s.begin) % ITEMSIZE[spec.dtype] == 0
            assert obj[s.name] == {
                "dtype": ST_CODE[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [s.begin, s.end],
            }
            cursor = s.end
        assert cursor == f.data_bytes


# ---- determinism ------------------------------------------------------------------------------
@SETTINGS
@given(spec_lists, shard_sizes, st.data())
def test_plan_is_deterministic_and_independent_of_input_order(specs, max_shard, data):
    plan = build_export_plan(specs, max_shard)
    again = build_export_plan(list(specs), max_shard)
    shuffled = build_export_plan(data.draw(st.permutations(specs)), max_shard)
    for other in (again, shuffled):
        assert [f.name for f in other.files] == [f.name for f in plan.files]
        assert [f.header for f in other.files] == [f.header for f in plan.files]
        assert [f.slots for f in other.files] == [f.slots for f in plan.files]
        assert other.index() == plan.index()


@SETTINGS
@given(spec_lists, shard_sizes)
def test_file_names_follow_hf_pattern(specs, max_shard):
    plan = build_export_plan(specs, max_shard)
    n = len(plan.files)
    assert n >= 1
    if n == 1:  # transformers' single-file layout, no index
        assert plan.files[0].name == "model.safetensors" and not plan.needs_index
        return
    assert plan.needs_index
    for i, f in enumerate(plan.files):
        m = FILE_NAME.match(f.name)
        assert m, f.name
        assert (int(m.group(1)), int(m.group(2))) == (i + 1, n)
        assert f.index == i


def test_prefix_and_metadata_arguments():
    plan = build_export_plan([TensorSpec("w", (2,), "float32")], 100, prefix="pd", metadata={"k": "v"})
    assert plan.files[0].name == "pd.safetensors" and not plan.needs_index  # one file: transformers' layout
    assert parse_header(plan.files[0].header)["__metadata__"] == {"k": "v"}


def test_natural_order_puts_layer_2_before_layer_10():
    specs = [TensorSpec(f"layers.{i}.w", (1,), "float32") for i in (10, 2, 1)]
    plan = build_export_plan(specs, 4)  # one tensor per file
    assert [f.slots[0].name for f in plan.files] == ["layers.1.w", "layers.2.w", "layers.10.w"]


def test_empty_plan_has_one_empty_file():
    plan = build_export_plan([], 10)
    assert len(plan.files) == 1 and plan.files[0].slots == ()
    assert plan.index() == {"metadata": {"total_size": 0}, "weight_map": {}}


# ---- writers ----------------------------------------------------------------------------------
@SETTINGS
@given(spec_lists, shard_sizes, st.integers(1, 12))
def test_assign_writers(specs, max_shard, n):
    plan = build_export_plan(specs, max_shard)
    owners = assign_writers(plan, n)
    assert len(owners) == len(plan.files)
    assert all(isinstance(w, int) and 0 <= w < n for w in owners)
    assert assign_writers(plan, n) == owners
    assert assign_writers(build_export_plan(list(reversed(specs)), max_shard), n) == owners
    if n >= len(plan.files):
        assert len(set(owners)) == len(owners), "a writer got two files while others were idle"
    # greedy largest-first: the busiest writer carries at most the average plus one file
    load = [0] * n
    for f, w in zip(plan.files, owners):
        load[w] += f.total_bytes
    sizes = [f.total_bytes for f in plan.files]
    assert max(load) <= sum(sizes) / n + max(sizes)


def test_assign_writers_docstring_example_and_bad_count():
    plan = build_export_plan([TensorSpec(f"t{i}", (i + 1,), "float32") for i in range(4)], 8)
    assert assign_writers(plan, 2) == (0, 1, 1, 0)
    assert assign_writers(plan, 1) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match="num_writers must be >= 1, got 0"):
        assign_writers(plan, 0)


# ---- golden bytes -----------------------------------------------------------------------------
def test_golden_header_bytes():
    plan = build_export_plan([TensorSpec("b", (3,), "float16"), TensorSpec("a", (2, 2), "float32")], 1000)
    (f,) = plan.files
    text = (
        b'{"__metadata__":{"format":"pt"},'
        b'"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
        b'"b":{"dtype":"F16","shape":[3],"data_offsets":[16,22]}}'
    )
    assert len(text) == 143
    expected = b"\x90\x00\x00\x00\x00\x00\x00\x00" + text + b" "  # 0x90 = 144 = 143 + 1 space of padding
    assert f.header == expected
    assert f.total_bytes == 8 + 144 + 22
    assert plan.index() == {
        "metadata": {"total_size": 22},
        "weight_map": {"a": "model.safetensors", "b": "model.safetensors"},
    }


def test_golden_larger_itemsize_first_keeps_alignment():
    plan = build_export_plan(
        [TensorSpec("a", (3,), "int8"), TensorSpec("b", (1,), "int64"), TensorSpec("c", (1,), "float16")], 1000
    )
    assert [(s.name, s.begin, s.end) for s in plan.files[0].slots] == [("b", 0, 8), ("c", 8, 10), ("a", 10, 13)]


# ---- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "specs, max_shard, match",
    [
        ([TensorSpec("dup.w", (1,), "float32"), TensorSpec("dup.w", (2,), "float32")], 10, r"'dup\.w' appears twice"),
        ([TensorSpec("neg.w", (2, -3), "float32")], 10, r"'neg\.w' has an invalid shape \(2, -3\)"),
        ([TensorSpec("odd.w", (2,), "float33")], 10, r"unsupported dtype 'float33'"),
        ([TensorSpec("w", (2,), "float32")], 0, r"max_shard_size must be positive, got 0"),
        ([TensorSpec("w", (2,), "float32")], -5, r"max_shard_size must be positive, got -5"),
        ([TensorSpec("", (2,), "float32")], 10, r"invalid tensor name ''"),
        ([TensorSpec("__metadata__", (2,), "float32")], 10, r"invalid tensor name '__metadata__'"),
    ],
)
def test_build_export_plan_rejects(specs, max_shard, match):
    with pytest.raises(ValueError, match=match):
        build_export_plan(specs, max_shard)


def test_tensor_spec_rejects_non_integer_shape():
    with pytest.raises(ValueError, match=r"tensor 'f\.w' has an invalid shape \(2\.5,\)"):
        TensorSpec("f.w", (2.5,), "float32")


# ---- regressions of bugs found and fixed -----------------------------------------------------
def test_plan_independent_of_order_with_leading_zeros():
    specs = [TensorSpec("a1", (2,), "float32"), TensorSpec("a01", (2,), "float32")]
    forward = build_export_plan(specs, 1000)
    backward = build_export_plan(specs[::-1], 1000)
    assert forward.files[0].header == backward.files[0].header


def test_unknown_dtype_message_names_tensor():
    with pytest.raises(ValueError, match=r"odd\.w"):
        build_export_plan([TensorSpec("odd.w", (2,), "float33")], 10)
