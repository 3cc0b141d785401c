"""The host side of an export, one part at a time: the export's groups (pure), the device boundary with
CPU tensors (shared, never copied; casts on the host), host casts equal to Paddle's, and the
selfcheck's pieces (its layouts, its own bfloat16 rounding against Paddle's)."""
from __future__ import annotations

import numpy as np
import pytest

from paddle_fullparam_callbacks.assemble.arrays import cast_array, region_of
from paddle_fullparam_callbacks.assemble.device import DeviceBoundary, dtype_of, host_array, on_device
from paddle_fullparam_callbacks.cli.selfcheck import layout
from paddle_fullparam_callbacks.cli.selfcheck.model import bfloat16_bits
from paddle_fullparam_callbacks.config import ConfigError, load_config
from paddle_fullparam_callbacks.plan.topology import plan_topology

paddle = pytest.importorskip("paddle")


@pytest.mark.parametrize("axes, stage, expected", [
    ([("pipe", 2), ("model", 2)], 1, [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)]),
    ([("data", 2), ("model", 2)], 1, [(0, 1, 2, 3), (0, 1), (2, 3)]),
    ([("data", 4)], 1, [(0, 1, 2, 3)]),
    ([("pipe", 4)], 1, [(0, 1, 2, 3), (0, 1, 2, 3)]),
    ([("sharding", 2), ("model", 2)], 3, [(0, 1, 2, 3), (0, 1, 2, 3)]),
])
def test_export_groups_are_the_world_then_each_meshs_rows_and_columns_in_mesh_order(axes, stage, expected):
    plan = plan_topology(axes, stage)
    groups = plan.export_groups()
    assert groups == expected
    for m in plan.meshes:  # each row and column listed in the order the assembler reads its gathers
        for row in m.rows:
            assert len(row) == 1 or tuple(row) in groups
        if len(m.rows) > 1:
            for col in zip(*m.rows):
                assert tuple(col) in groups


def test_a_cpu_tensor_is_shared_with_the_host_array_never_copied():
    t = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    arr = host_array(t)
    assert not on_device(t) and dtype_of(t) == "float32"
    assert arr.ctypes.data == t.data_ptr() and arr.tolist() == t.numpy().tolist()
    b = DeviceBoundary(budget=0)
    bf = t.astype("bfloat16")
    got, dtype = b.host_array(bf)
    assert dtype == "bfloat16" and got.dtype == np.uint16 and got.ctypes.data == bf.data_ptr()
    assert b.stats.d2h_bytes == 0  # nothing left a device


def test_the_boundary_casts_cpu_tensors_on_the_host_with_paddles_bits():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 7)).astype(np.float32)
    b = DeviceBoundary(budget=64 * 2**20)
    got, dtype = b.host_array(paddle.to_tensor(x), cast_to="bfloat16")  # lazy: cast where it is written
    want = paddle.to_tensor(x).astype("bfloat16").view(paddle.uint16).numpy()
    assert dtype == "bfloat16" and np.asarray(got).tobytes() == want.tobytes()
    assert b.stats.host_casts == 1 and b.stats.device_casts == 0
    same, dtype = b.host_array(paddle.to_tensor(np.arange(3, dtype=np.int64)), cast_to="bfloat16")
    assert dtype == "int64" and same.tolist() == [0, 1, 2]  # integers are never cast


def test_host_casts_of_strided_views_equal_paddles_cast_of_the_whole_tensor():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((70, 33)).astype(np.float32)
    view = region_of(x.T, (3, 5), (20, 40))
    for dst in ("bfloat16", "float16"):
        want = paddle.to_tensor(np.ascontiguousarray(view)).astype(dst)
        want = (want.view(paddle.uint16) if dst == "bfloat16" else want).numpy()
        assert cast_array(view, "float32", dst).tobytes() == want.tobytes()


def test_selfcheck_bfloat16_rounding_agrees_with_paddles_cast():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32),
                        np.array([1.00390625, 1.01171875, -1.00390625, 3.4e38, 1e-40], np.float32)])
    assert bfloat16_bits(x).tobytes() == paddle.to_tensor(x).astype("bfloat16").view(paddle.uint16).numpy().tobytes()


def test_selfcheck_layouts():
    assert [layout(n) for n in (1, 2, 3, 4, 5, 6, 8, 12)] == [
        (1, 1, 1), (2, 1, 1), (1, 1, 3), (2, 2, 1), (1, 1, 5), (2, 1, 3), (2, 2, 2), (2, 2, 3)]
    for n in range(1, 17):
        mp, pp, dp = layout(n)
        assert mp * pp * dp == n


def test_device_memory_budget_is_a_size_and_zero_is_allowed():
    assert load_config(None, ["export.device_memory_budget=0"]).export.device_budget == 0
    assert load_config(None, []).export.device_budget == 64 * 10**6
    assert load_config(None, ["export.device_memory_budget=1GiB"]).export.device_budget == 2**30
    with pytest.raises(ConfigError, match="export.device_memory_budget: not a size: 'lots'"):
        load_config(None, ["export.device_memory_budget=lots"])
    with pytest.raises(ConfigError, match="export.device_memory_budget"):
        load_config(None, ["export.device_memory_budget=-1MB"])
