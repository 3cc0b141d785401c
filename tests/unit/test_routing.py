"""Placement and routing (plan/placement.py, plan/routing.py): pure plans from shapes and holdings, no
processes. Layouts are built here as a tensor-parallel/pipeline job would hold them; every case checks the
floor (a writer receives exactly the bytes it lacks, once; nothing it holds moves), that the packets bring
each writer every piece its destinations read, and that they run to the end under blocking sends."""
from __future__ import annotations

import doctest
import math
from collections import defaultdict

import pytest

from paddle_fullparam_callbacks.plan import boxes, export_plan, placement, routing
from paddle_fullparam_callbacks.plan.boxes import Holding, Need, intersect
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec
from paddle_fullparam_callbacks.plan.placement import plan_placement
from paddle_fullparam_callbacks.plan.routing import plan_routes
from paddle_fullparam_callbacks.plan.topology import plan_topology

F32 = 4


@pytest.mark.parametrize("module", [boxes, export_plan, placement, routing])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


class Layout:
    """Tensors of one mesh: name -> global shape, and who holds which box (ranks of mesh 0)."""

    def __init__(self):
        self.shapes, self.holdings = {}, []

    def whole(self, name, shape, ranks):
        self.shapes[name] = tuple(shape)
        self.holdings += [Holding(r, name, (0,) * len(shape), tuple(shape), F32) for r in ranks]

    def split(self, name, shape, axis, ranks):
        self.shapes[name] = tuple(shape)
        n = shape[axis] // len(ranks)
        for i, r in enumerate(ranks):
            off = [0] * len(shape)
            off[axis] = i * n
            sh = list(shape)
            sh[axis] = n
            self.holdings.append(Holding(r, name, tuple(off), tuple(sh), F32))

    def identity(self):
        specs = [TensorSpec(n, s, "float32") for n, s in self.shapes.items()]
        needs = {n: [Need(n, n, (0,) * len(s), s)] for n, s in self.shapes.items()}
        return specs, needs


def llama(stages, mp, layers=4, h=64, inter=128, vocab=256):
    """Stage s holds its layers; every Linear split over its row (column- or row-parallel), norms replicated."""
    lay = Layout()
    per = math.ceil(layers / len(stages))
    first, last = stages[0], stages[-1]
    lay.split("model.embed_tokens.weight", (vocab, h), 0, first)
    for i in range(layers):
        row = stages[i // per]
        for p in ("q", "k", "v"):
            lay.split(f"model.layers.{i}.self_attn.{p}_proj.weight", (h, h), 1, row)
        lay.split(f"model.layers.{i}.self_attn.o_proj.weight", (h, h), 0, row)
        lay.split(f"model.layers.{i}.mlp.up_proj.weight", (h, inter), 1, row)
        lay.split(f"model.layers.{i}.mlp.down_proj.weight", (inter, h), 0, row)
        lay.whole(f"model.layers.{i}.input_layernorm.weight", (h,), row)
    lay.whole("model.norm.weight", (h,), last)
    lay.split("lm_head.weight", (h, vocab), 1, last)
    return lay


def plan_all(lay, topo, max_shard, nodes=None, specs_needs=None, bucket=4096, chunk=8192):
    specs, needs = specs_needs or lay.identity()
    placed = plan_placement(specs, needs, lay.holdings, topo, 0, max_shard, nodes)
    order = [s.name for f in placed.plan.files for s in sorted(f.slots, key=lambda s: s.begin)]
    mesh0 = set(topo.meshes[0].ranks)
    # the plan of mesh 0: its files (replica meshes get the same plan at their own ranks)
    files0 = {i for i, w in enumerate(placed.writes.file_writer) if w in mesh0}
    mine = [n for n in order if placed.plan.slots[n].file_index in files0]
    writer_of = {n: placed.writes.file_writer[placed.plan.slots[n].file_index] for n in mine}
    routes = plan_routes(mine, writer_of, needs, lay.holdings, nodes, bucket, chunk)
    return placed, routes, writer_of, needs


def lacked(lay, needs, writer_of):
    """The floor: per writer, the bytes of its destinations' sources it does not hold (each piece once)."""
    idx = boxes.HoldingIndex(lay.holdings)
    out, seen = defaultdict(int), set()
    for dest, w in writer_of.items():
        for need in needs[dest]:
            for piece in idx.pieces(need):
                ident = (w, piece.key, piece.offset, piece.shape)
                if w not in piece.holders and ident not in seen:
                    seen.add(ident)
                    out[w] += piece.nbytes
    return out


def run_blocking(routes, ranks):
    """Each rank carries out its packets in order; a packet completes when both ends stand at it."""
    queues = {r: routes.packets_of(r) for r in ranks}
    pos = {r: 0 for r in ranks}
    done = 0
    while True:
        progressed = False
        for r in ranks:
            if pos[r] >= len(queues[r]):
                continue
            p = queues[r][pos[r]]
            other = p.dst if p.src == r else p.src
            if pos[other] < len(queues[other]) and queues[other][pos[other]] is p:
                pos[r] += 1
                pos[other] += 1
                done += 1
                progressed = True
        if not progressed:
            break
    assert all(pos[r] == len(queues[r]) for r in ranks), "deadlock: " + str(pos)
    return done


def makespan(packets, latency=1000):
    """The time the packets take when each costs ``latency + nbytes`` and occupies both its ends, each rank
    taking its own in the global order (a blocking send and its receive); and the bound no order beats:
    the busiest rank's own total, or all of it spread over the ``n // 2`` packets that can run at once."""
    clock, load = defaultdict(int), defaultdict(int)
    for p in packets:
        cost = latency + p.nbytes
        clock[p.src] = clock[p.dst] = max(clock[p.src], clock[p.dst]) + cost
        load[p.src] += cost
        load[p.dst] += cost
    at_once = max(1, len(load) // 2)
    return max(clock.values(), default=0), max(max(load.values(), default=0), sum(load.values()) // 2 / at_once)


def check_coverage(lay, routes, needs, writer_of):
    """What a writer holds plus what the moves bring it covers every box its destinations read."""
    have = defaultdict(list)
    for h in lay.holdings:
        have[(h.rank, h.key)].append((h.offset, h.shape))
    for m in routes.moves:
        have[(m.dst, m.key)].append((m.offset, m.shape))
    for dest, w in writer_of.items():
        for need in needs[dest]:
            covered = sum(math.prod(c[1]) for b in have[(w, need.key)]
                          if (c := intersect(b[0], b[1], need.offset, need.shape)) is not None)
            assert covered >= math.prod(need.shape), (dest, w)


@pytest.mark.parametrize("axes, max_shard", [
    ([("pipe", 2), ("model", 2)], 20_000),
    ([("model", 4)], 30_000),
    ([("data", 2), ("model", 2)], 20_000),
    ([("pipe", 4), ("model", 2)], 10_000),
    ([("model", 8)], 30_000),
    ([("model", 3)], 60_000),  # an odd number of ranks: each round of the order leaves one out
])
def test_tensor_parallel_meshes_receive_only_the_bytes_their_writers_lack(axes, max_shard):
    topo = plan_topology(axes)
    mesh = topo.meshes[0]
    dims = dict(h=96, inter=192, vocab=384) if len(mesh.rows[0]) == 3 else {}
    lay = llama([list(row) for row in mesh.rows], len(mesh.rows[0]), **dims)
    placed, routes, writer_of, needs = plan_all(lay, topo, max_shard)
    floor = lacked(lay, needs, writer_of)
    written = defaultdict(int)
    for f, w in zip(placed.plan.files, placed.writes.file_writer):
        written[w] += f.data_bytes
    for r in mesh.ranks:
        t = routes.traffic.get(r, routing.RankTraffic())
        assert t.received == floor[r]  # the floor: each lacked byte once, nothing held moves
        assert t.received <= written[r]  # no rank receives more than it writes
    pos0 = placement.positions(mesh)
    for f, w in zip(placed.plan.files, placed.writes.file_writer):  # a file is written inside its stage
        stage = placement.positions(topo.mesh_of(w))[w][0]  # (a replica mesh's rank: by its position)
        held_by = {pos0[h.rank][0] for s in f.slots for h in lay.holdings if h.key == s.name}
        assert stage in held_by
    total = sum(f.data_bytes for f in placed.plan.files)
    mp = len(mesh.rows[0])
    assert routes.total() <= (1 - 1 / mp) * total * len(topo.meshes) / len(topo.meshes) + 1  # the split half moves
    assert placed.balance <= placement.BALANCE_LIMIT, placed.note
    check_coverage(lay, routes, needs, writer_of)
    assert run_blocking(routes, list(mesh.ranks)) == len(routes.packets)
    span, bound = makespan(routes.packets)
    assert span <= 1.25 * bound  # disjoint pairs transfer at once: the busiest rank hardly waits
    again = plan_all(llama([list(row) for row in mesh.rows], len(mesh.rows[0]), **dims), topo, max_shard)
    assert again[0].writes == placed.writes and again[1].packets == routes.packets  # the same on every rank


def test_a_mesh_of_one_and_pure_data_parallel_move_nothing():
    topo = plan_topology([("data", 4)])
    lay = llama([[0]], 1)
    placed, routes, _, _ = plan_all(lay, topo, 20_000)
    assert routes.moves == () and routes.packets == ()
    assert len(set(placed.writes.file_writer)) == 4 and placed.balance <= placement.BALANCE_LIMIT


def test_experts_are_written_by_the_ranks_that_hold_them():
    topo = plan_topology([("expert", 4)])
    lay = Layout()
    lay.split("model.embed_tokens.weight", (64, 32), 0, [0, 1, 2, 3])
    for layer in range(2):
        for e in range(8):
            for p in ("gate", "up", "down"):
                lay.whole(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight", (32, 48), [e // 2])
        lay.whole(f"model.layers.{layer}.mlp.gate.weight", (8, 32), [0, 1, 2, 3])
    placed, routes, writer_of, needs = plan_all(lay, topo, 40_000)
    for name, w in writer_of.items():
        if ".experts." in name:
            assert w == int(name.split(".experts.")[1].split(".")[0]) // 2, name
    assert sum(m.nbytes for m in routes.moves) == 64 * 32 * F32 * 3 // 4  # only the split embedding moves
    assert placed.balance <= placement.BALANCE_LIMIT, placed.note


def test_a_fused_weight_moves_only_the_columns_each_destination_reads():
    """A fused qkv [16, 48] split by columns over 2 ranks; q, k, v each read 16 columns."""
    topo = plan_topology([("model", 2)])
    lay = Layout()
    lay.split("qkv", (16, 48), 1, [0, 1])
    specs = [TensorSpec(n, (16, 16), "float32") for n in ("q", "k", "v")]
    needs = {n: [Need(n, "qkv", (0, 16 * i), (16, 16))] for i, n in enumerate(("q", "k", "v"))}
    placed, routes, writer_of, _ = plan_all(lay, topo, 10**9, specs_needs=(specs, needs))
    assert sum(m.nbytes for m in routes.moves) == sum(lacked(lay, needs, writer_of).values())
    assert all(m.shape[1] <= 16 for m in routes.moves)  # never the whole 24-column slice
    check_coverage(lay, routes, needs, writer_of)


@pytest.mark.parametrize("axes, nodes", [
    ([("pipe", 2), ("model", 2)], {0: 0, 1: 0, 2: 1, 3: 1}),  # stages on two nodes
    ([("data", 2), ("model", 2)], {0: 0, 1: 0, 2: 1, 3: 1}),  # replicas on two nodes
    ([("pipe", 2), ("model", 4)], {r: r // 4 for r in range(8)}),
])
def test_nothing_crosses_nodes_when_only_pipe_or_data_spans_them(axes, nodes):
    topo = plan_topology(axes)
    lay = llama([list(row) for row in topo.meshes[0].rows], len(topo.meshes[0].rows[0]))
    placed, routes, writer_of, needs = plan_all(lay, topo, 20_000, nodes)
    assert routes.total("received_cross_node") == 0
    assert all(not m.cross_node for m in routes.moves)
    assert routes.total() == sum(lacked(lay, needs, writer_of).values())


def test_a_sender_on_the_writers_node_is_preferred_and_senders_share_the_load():
    lay = Layout()
    lay.whole("a", (1000,), [1, 2, 3])  # replicas on 1 (node 1), 2 and 3 (node 0)
    lay.whole("b", (1000,), [1, 2, 3])
    needs = {n: [Need(n, n, (0,), (1000,))] for n in "ab"}
    routes = plan_routes(["a", "b"], {"a": 0, "b": 0}, needs, lay.holdings, {0: 0, 1: 1, 2: 0, 3: 0})
    assert [m.src for m in routes.moves] == [2, 3]  # node 0 first, then the one that has sent less
    assert routes.total("received_cross_node") == 0


def test_small_moves_are_coalesced_and_large_ones_chunked():
    lay = Layout()
    for i in range(10):
        lay.whole(f"s{i}", (10,), [1])  # 40 bytes each
    lay.whole("big", (5000,), [1])  # 20000 bytes
    names = [f"s{i}" for i in range(10)] + ["big"]
    needs = {n: [Need(n, n, (0,) * len(lay.shapes[n]), lay.shapes[n])] for n in names}
    routes = plan_routes(names, {n: 0 for n in names}, needs, lay.holdings, None, bucket_bytes=200, chunk_bytes=8192)
    small = [p for p in routes.packets if p.chunk is None]
    assert [len(p.moves) for p in small] == [5, 5] and all(p.nbytes <= 200 for p in small)
    assert [p.chunk for p in routes.packets if p.chunk] == [(0, 8192), (8192, 16384), (16384, 20000)]


def test_placement_says_why_writers_are_unbalanced():
    topo = plan_topology([("pipe", 2), ("model", 2)])
    lay = llama([list(row) for row in topo.meshes[0].rows], 2)
    placed = plan_placement(*lay.identity(), lay.holdings, topo, 0, 10**9)
    assert len(placed.plan.files) < 4 and placed.balance > placement.BALANCE_LIMIT
    assert "file(s) for 4 ranks" in placed.note


# ---- predictions before a job (plan/prediction.py, `paddle-fullparam plan --model`) ---------------------

from paddle_fullparam_callbacks.plan import model_shapes, prediction  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, torch_dtype="bfloat16")


@pytest.mark.parametrize("module", [model_shapes, prediction])
def test_prediction_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_the_layout_holds_every_tensor_once_per_replica_and_splits_linears_over_the_row():
    shapes, dtype = model_shapes.decoder_shapes(SMALL)
    topo = plan_topology([("pipe", 2), ("model", 2)])
    held = prediction.job_holdings(shapes, dtype, topo)
    for name, shape in shapes.items():  # the distinct boxes of a tensor tile it
        boxes_ = {(h.offset, h.shape) for h in held if h.key == name}
        assert sum(math.prod(s) for _, s in boxes_) == math.prod(shape), name
    q = [h for h in held if h.key == "model.layers.3.self_attn.q_proj.weight"]
    assert sorted(h.rank for h in q) == [2, 3] and {h.shape for h in q} == {(32, 64)}  # stage 1, split on out
    o = [h for h in held if h.key == "model.layers.0.self_attn.o_proj.weight"]
    assert sorted(h.rank for h in o) == [0, 1] and {h.shape for h in o} == {(64, 32)}  # row-parallel: on in
    assert sorted(h.rank for h in held if h.key == "model.norm.weight") == [2, 3]  # replicated on the last stage


def test_the_prediction_is_the_floor_and_far_below_the_seed_schedule():
    shapes, dtype = model_shapes.decoder_shapes(SMALL)
    out = prediction.predict(shapes, dtype, plan_topology([("pipe", 2), ("model", 2)]), 20_000, {0: 0, 1: 0, 2: 1, 3: 1})
    ranks = out["ranks"]
    assert all(t.get("received", 0) == t.get("floor", 0) <= t.get("writes", 0) for t in ranks.values())
    received = sum(t.get("received", 0) for t in ranks.values())
    assert 0.4 * out["snapshot_bytes"] < received <= 0.6 * out["snapshot_bytes"]  # mp2: about half moves
    assert sum(t.get("received_cross_node", 0) for t in ranks.values()) == 0  # stages on their own nodes
    assert all(t["seed_received"] > 1.5 * t.get("received", 0) for t in ranks.values())


def test_experts_on_their_own_ranks_predict_no_traffic():
    shapes, dtype = model_shapes.decoder_shapes({**SMALL, "num_local_experts": 4})
    out = prediction.predict(shapes, dtype, plan_topology([("expert", 4)]), 50_000)
    assert sum(t.get("received", 0) for t in out["ranks"].values()) == 0
    with pytest.raises(ValueError, match="4 experts do not spread evenly over 3"):
        prediction.predict(shapes, dtype, plan_topology([("expert", 3)]), 50_000)


def test_plan_with_a_model_prints_every_rank_and_the_totals(tmp_path):
    import json as json_
    import subprocess
    import sys

    cfg = tmp_path / "config.json"
    cfg.write_text(json_.dumps(SMALL))
    run = lambda *a: subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "plan", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("--pp", "2", "--mp", "2", "--model", str(cfg), "--max-shard-size", "20KB", "--ranks-per-node", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("  rank ") == 4 and "in all: received" in r.stdout and "the floor" in r.stdout
    assert "across nodes 0.00 GB" in r.stdout
    j = json_.loads(run("--pp", "2", "--mp", "2", "--model", str(cfg), "--json").stdout)
    assert set(j["ranks"]) == {"0", "1", "2", "3"} and j["snapshot_bytes"] > 0
    r = run("--mp", "2", "--model", "Llama-9-1T")
    assert r.returncode == 2 and "unknown model 'Llama-9-1T'" in r.stderr and "Traceback" not in r.stderr
    assert run("--mp", "2", "--model", "llama-2-7b", "--json").returncode == 0


def test_files_are_cut_below_the_limit_so_every_candidate_writer_gets_one():
    """With a large max_shard_size, a stage's tensors still go to as many files as the stage has writers
    (contiguous runs of even size), when that keeps files above the split floor."""
    topo = plan_topology([("pipe", 2), ("model", 2)])
    lay = llama([list(row) for row in topo.meshes[0].rows], 2, layers=8)
    specs, needs = lay.identity()
    kept = plan_placement(specs, needs, lay.holdings, topo, 0, 10**9)  # default floor (64 MB): one file per group
    cut = plan_placement(specs, needs, lay.holdings, topo, 0, 10**9, split_floor=1)
    assert len(cut.plan.files) >= 4 > len(kept.plan.files)
    assert cut.balance <= placement.BALANCE_LIMIT and len(set(cut.writes.file_writer)) == 4
    assert all(f.data_bytes <= 10**9 for f in cut.plan.files)
