"""Topology plan properties over every hybrid topology of up to 16 ranks."""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paddle_fullparam_callbacks.plan.topology import plan_topology, plan_writes

ORDER = ("data", "pipe", "sharding", "sep", "model")


def all_topologies(max_ranks=16):
    for degrees in itertools.product(range(1, 17), repeat=5):
        if math.prod(degrees) <= max_ranks:
            for stage in (1, 3):
                if stage == 3 and degrees[2] == 1:
                    continue
                yield list(zip(ORDER, degrees)), stage


TOPOLOGIES = list(all_topologies())


def coords_of(rank, axes):
    out = {}
    for name, d in reversed(axes):
        out[name] = rank % d
        rank //= d
    return out


def test_enumeration_is_not_empty():
    assert len(TOPOLOGIES) > 200


@pytest.mark.parametrize("axes, stage", TOPOLOGIES[::7] + TOPOLOGIES[-5:])
def test_meshes_tile_ranks_and_hold_whole_replicas(axes, stage):
    plan = plan_topology(axes, stage)
    world = math.prod(d for _, d in axes)
    ranks = sorted(r for m in plan.meshes for r in m.ranks)
    assert ranks == list(range(world))  # every rank in exactly one mesh
    replica = {"data", "sep"} | ({"sharding"} if stage != 3 else set())
    degree = dict(axes)
    assert plan.num_splits == math.prod(degree[a] for a in replica)
    for m in plan.meshes:
        cs = [coords_of(r, axes) for r in m.ranks]
        # one replica: all ranks share the replica coordinates ...
        for a in replica:
            assert len({c[a] for c in cs}) == 1
        # ... and together hold every model-parallel coordinate exactly once
        mp_axes = [a for a in ORDER if a not in replica]
        assert sorted(tuple(c[a] for a in mp_axes) for c in cs) == sorted(itertools.product(*[range(degree[a]) for a in mp_axes]))
        # rows vary only horizontal axes, columns only pipe
        for row in m.rows:
            assert len({coords_of(r, axes)["pipe"] for r in row}) == 1
        for col in zip(*m.rows):
            assert len({tuple(v for k, v in coords_of(r, axes).items() if k != "pipe") for r in col}) == 1
        for r in m.ranks:
            assert r in m.h_ranks(r) and r in m.v_ranks(r)
            assert set(m.h_ranks(r)) & set(m.v_ranks(r)) == {r}


def _synthetic_shards(axes, stage, shape=(8, 12)):
    """Each rank's slice of a column-parallel weight of every pipe stage (stage 3: split over sharding too)."""
    degree = dict(axes)
    shards = {}
    for r in range(math.prod(degree.values())):
        c = coords_of(r, axes)
        parts = degree["model"] * (degree["sharding"] if stage == 3 else 1)
        idx = c["model"] + degree["model"] * (c["sharding"] if stage == 3 else 0)
        width = shape[1] // parts if shape[1] % parts == 0 else None
        if width is None:
            continue
        shards[r] = (f"layers.{c['pipe']}.w", idx * width, width)
    return shards


@pytest.mark.parametrize("axes, stage", [t for t in TOPOLOGIES if 12 % (dict(t[0])["model"] * (dict(t[0])["sharding"] if t[1] == 3 else 1)) == 0][::5])
def test_every_mesh_reaches_every_slice_of_every_parameter(axes, stage):
    plan = plan_topology(axes, stage)
    shards = _synthetic_shards(axes, stage)
    degree = dict(axes)
    for m in plan.meshes:
        covered = {}
        for r in m.ranks:
            key, off, width = shards[r]
            covered.setdefault(key, np.zeros(12, int))[off:off + width] += 1
        assert sorted(covered) == sorted(f"layers.{p}.w" for p in range(degree["pipe"]))
        assert all((v == 1).all() for v in covered.values())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TOPOLOGIES), st.lists(st.integers(0, 10**9), min_size=0, max_size=40))
def test_every_file_has_exactly_one_writer_in_its_mesh(topo, sizes):
    axes, stage = topo
    plan = plan_topology(axes, stage)
    w = plan_writes(plan, sizes)
    assert len(w.file_writer) == len(sizes) == len(w.file_mesh)
    for f, (mesh, writer) in enumerate(zip(w.file_mesh, w.file_writer)):
        assert writer in plan.meshes[mesh].ranks
        assert [f] == [g for g in w.files_of_rank(writer) if g == f]
    assert sorted(f for fs in w.writers().values() for f in fs) == list(range(len(sizes)))
    # identical on every rank: the plan is a function of its inputs only
    assert plan_writes(plan_topology(axes, stage), sizes) == w
    # balanced: no mesh holds more than the average plus the largest file
    if sizes:
        per_mesh = [sum(s for s, m in zip(sizes, w.file_mesh) if m == i) for i in range(plan.num_splits)]
        assert max(per_mesh) <= sum(sizes) / plan.num_splits + max(sizes)


def test_pure_data_parallel_is_meshes_of_one():
    plan = plan_topology([("data", 4)])
    assert [m.rows for m in plan.meshes] == [((0,),), ((1,),), ((2,),), ((3,),)]


@pytest.mark.parametrize("axes, stage, message", [
    ([("model", 0)], 1, "degree of axis 'model' must be a whole number >= 1"),
    ([("tensor", 2)], 1, "unknown parallel axis 'tensor'"),
    ([("mp", 2), ("model", 2)], 1, "given twice"),
    ([("model", 2)], 4, "sharding stage must be 0, 1, 2 or 3"),
])
def test_bad_topologies(axes, stage, message):
    with pytest.raises(ValueError, match=message):
        plan_topology(axes, stage)


def test_cli_plan_json():
    out = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "plan", "--dp", "2", "--pp", "2", "--mp", "2",
                          "--files", "5", "--json"], capture_output=True, text=True, check=True)
    obj = json.loads(out.stdout)
    assert obj["num_splits"] == 2
    assert obj["meshes"][0] == {"h": [[0, 1], [2, 3]], "v": [[0, 2], [1, 3]]}
    assert sorted(f for fs in obj["writers"].values() for f in fs) == [0, 1, 2, 3, 4]


def test_experts_spread_over_the_data_axis_join_the_mesh():
    # PaddleFormers' moe_group=data: dp ranks hold different experts, so dp is no longer a replica axis
    t = plan_topology([("data", 2), ("pipe", 1), ("sharding", 2), ("sep", 1), ("model", 2)], 1, ["data"])
    assert t.horizontal_axes == ("data", "model") and t.replica_axes == ("sharding", "sep")
    assert [m.rows for m in t.meshes] == [((0, 1, 4, 5),), ((2, 3, 6, 7),)]  # sharding replicas still split
    # a dedicated expert axis joins without being asked
    e = plan_topology([("data", 2), ("expert", 2), ("model", 2)])
    assert e.horizontal_axes == ("expert", "model") and [m.rows for m in e.meshes] == [((0, 1, 2, 3),), ((4, 5, 6, 7),)]
    with pytest.raises(ValueError, match="experts cannot be placed over axis 'pipe'"):
        plan_topology([("pipe", 2), ("model", 2)], 1, ["pipe"])


def test_cli_plan_shows_the_expert_axis():
    from paddle_fullparam_callbacks.cli.main import main

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--dp", "2", "--mp", "2", "--experts-over", "data", "--json"]) == 0
    out = json.loads(buf.getvalue())
    assert out["horizontal_axes"] == ["data", "expert", "model"] and out["num_splits"] == 1
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["plan", "--dp", "2", "--ep", "2", "--mp", "2"]) == 0
    assert "mesh rows (horizontal) over expert, model" in buf.getvalue()


@pytest.mark.parametrize("moe_group, axes", [
    ("dp", ("data",)), ("data", ("data",)), ("mp", ("model",)), ("tp", ("model",)), ("dummy", ()),
    ("world", ("data", "sharding", "sep", "context", "model")), (None, ()),
])
def test_expert_axes_from_the_models_moe_group(moe_group, axes):
    from types import SimpleNamespace

    from paddle_fullparam_callbacks.trainer.topology import expert_axes_of

    assert expert_axes_of(SimpleNamespace(config=SimpleNamespace(moe_group=moe_group))) == axes
    # PaddleFormers replaces config.moe_group by the group object and keeps the text here
    assert expert_axes_of(SimpleNamespace(config=SimpleNamespace(moe_group=object(), moe_group_origin=moe_group))) == axes
