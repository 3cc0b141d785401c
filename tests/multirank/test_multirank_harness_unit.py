"""Single-process checks of the multi-rank harness's numpy side (no launch): expected values,
dump/reassemble of hand-made shard layouts, and that reassembly rejects gaps and disagreeing
overlaps."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

paddle = pytest.importorskip("paddle")
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight  # noqa: E402


def _shard(key, full, offset, local_shape, dtype="float32"):
    sl = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    t = paddle.to_tensor(np.ascontiguousarray(full[sl]))
    if dtype != "float32":
        t = t.astype(dtype)
    return ShardedWeight(key, t, tuple(local_shape), tuple(full.shape), tuple(offset))


def test_expected_values_exact_in_all_dtypes_and_step_dependent():
    e = harness.expected_global("w", (6, 10), 3)
    assert e.dtype == np.float32
    assert np.array_equal(harness.expected_global("w", (6, 10), 3, "float16").astype(np.float32), e)
    bits = harness.expected_global("w", (6, 10), 3, "bfloat16")
    assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), e)
    assert np.array_equal(harness.expected_block("w", (6, 10), (2, 5), (3, 5), 3), e[2:5, 5:10])
    assert not np.array_equal(harness.expected_global("w", (6, 10), 4), e)
    assert not np.array_equal(harness.expected_global("v", (6, 10), 3), e)
    assert len(np.unique(harness.expected_global("w", (4096,), 0))) > 2000


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dump_and_reassemble_column_row_and_replicas(tmp_path, dtype):
    a = harness.expected_global("a", (4, 6), 1)
    b = harness.expected_global("b", (8,), 1)
    # "rank 0/1": column split of a, b replicated on both
    harness.dump_shards({"a": _shard("a", a, (0, 0), (4, 3), dtype), "b": _shard("b", b, (0,), (8,), dtype)},
                        tmp_path / "r0.npz")
    harness.dump_shards({"a": _shard("a", a, (0, 3), (4, 3), dtype), "b": _shard("b", b, (0,), (8,), dtype)},
                        tmp_path / "r1.npz")
    full, count = harness.reassemble(tmp_path, return_coverage=True)
    assert count == {"a": 2, "b": 2}
    assert full["a"].tobytes() == harness.expected_global("a", (4, 6), 1, dtype).tobytes()
    assert full["b"].tobytes() == harness.expected_global("b", (8,), 1, dtype).tobytes()


def test_reassemble_flattened_ranges(tmp_path):
    a = harness.expected_global("a", (4, 6), 2)
    # local block rows 0..4, cols 3..6 (12 elements) split flat as [0:5] and [5:12]
    block = np.ascontiguousarray(a[:, 3:6]).reshape(-1)
    for i, (lo, hi) in enumerate([(0, 5), (5, 12)]):
        sw = ShardedWeight("a", paddle.to_tensor(block[lo:hi]), (4, 3), (4, 6), (0, 3),
                           is_flattened=True, flattened_range=slice(lo, hi))
        harness.dump_shards({"a": sw}, tmp_path / f"f{i}.npz")
    harness.dump_shards({"a": _shard("a", a, (0, 0), (4, 3))}, tmp_path / "left.npz")
    assert np.array_equal(harness.reassemble(tmp_path)["a"], a)


def test_reassemble_rejects_gap_and_disagreeing_overlap(tmp_path):
    a = harness.expected_global("a", (4, 6), 1)
    gap = tmp_path / "gap"
    harness.dump_shards({"a": _shard("a", a, (0, 0), (4, 3))}, gap / "r0.npz")
    with pytest.raises(AssertionError, match="covered by no shard"):
        harness.reassemble(gap)
    bad = tmp_path / "bad"
    harness.dump_shards({"a": _shard("a", a, (0, 0), (4, 6))}, bad / "r0.npz")
    other = a.copy()
    other[3, 5] = np.nextafter(other[3, 5], np.float32(1e9))  # one ulp on one element
    harness.dump_shards({"a": _shard("a", other, (2, 3), (2, 3))}, bad / "r1.npz")
    with pytest.raises(AssertionError, match="overlapping shards differ"):
        harness.reassemble(bad)
