"""Multi-rank CPU (gloo) test harness: real hybrid topology, real tensor-parallel layers,
deterministic "optimizer steps", and a communication-free way to check gathered tensors.

Import it inside a rank started by ``python -m paddle.distributed.launch``
(``sys.path.insert(0, <this folder>)``; it needs only paddle and numpy, so it works in both the
PaddleFormers and the PaddleNLP environments).

API
---
- ``init_fleet(dp=1, mp=1, pp=1, sharding=1, sep=1, sharding_stage=1, seed=0) -> HybridCommunicateGroup``
- ``rank_info(hcg) -> dict``: rank, coordinates, group ranks (JSON-able)
- ``TinyParallelLlama(vocab=64, hidden=16, inter=32, layers=4, heads=4, kv_heads=2, hcg=None)``
- ``global_param_shapes(vocab=64, hidden=16, inter=32, layers=4, heads=4, kv_heads=2) -> {key: shape}``
- ``sharded_state_dict(model) -> {key: ShardedWeight}`` (built from the harness's own layout table)
- ``compare_sharded_state_dicts(a, b) -> [problem strings]``
- ``perturb(model, step)``; ``expected_global(name, global_shape, step, dtype="float32") -> np.ndarray``;
  ``expected_block(name, global_shape, global_offset, local_shape, step, dtype="float32")``
- ``dump_shards(sd, path) -> file``; ``reassemble(dump_dir) -> {key: np.ndarray}``
- ``tensor_to_numpy_bits(t)``, ``dtype_name(t)``, ``np_storage_dtype(name)``
- ``gloo_safe_group_creation()``: context manager, for groups a test creates itself after ``init_fleet``
- ``run_launch(script, args, nproc=4, log_dir=None, timeout=300, devices=None) -> LaunchResult`` (from pytest,
  outside the ranks): runs ``python -m paddle.distributed.launch``, kills the whole process group on
  timeout, returns rc, wall time, per-rank logs and tagged JSON lines (``result.tagged("PROBE")``)

Facts about Paddle 3.3.1 (verified with 4 ranks on CPU/gloo, see probe_harness.py)
-----------------------------------------------------------------------------------
Axis order. ``fleet.init`` builds ``CommunicateTopology(hybrid_group_names, dims)`` from
``strategy.hybrid_parallel_order`` (default ``['dp', 'pp', 'sharding', 'sep', 'cp', 'mp']``), i.e. the
axis names are, outermost first::

    ["data", "pipe", "sharding", "sep", "context", "model"]

Ranks are assigned by ``itertools.product`` over these axes in that order, so the LAST axis
("model") varies fastest: global rank = ((((d*P + p)*S + s)*E + e)*C + c)*M + m. Examples
(4 ranks): dp2 x mp2 -> rank r has data=r//2, model=r%2 (mp groups [0,1],[2,3]; dp groups
[0,2],[1,3]); mp2 x pp2 -> pipe=r//2, model=r%2 (mp groups [0,1],[2,3]; pp groups [0,2],[1,3]);
sharding2 x mp2 -> sharding=r//2, model=r%2. The order can be changed with
``hybrid_configs["order"]``; ``init_fleet`` keeps the default. Paddle's own check of a custom
order is a no-op in 3.3.1 (it compares ``list.sort()`` results, both ``None``).

Coordinates. ``hcg.topology().get_coord(rank)`` -> namedtuple
``Coordinate(data=, pipe=, sharding=, sep=, context=, model=)`` (``._asdict()`` for a dict);
``hcg.topology().get_rank(data=.., pipe=.., sharding=.., sep=.., context=.., model=..)`` is the
inverse (all axes required); ``get_comm_list(axis)`` lists every group along an axis;
``get_hybrid_group_names()`` gives the order.

Groups on the HCG (each a ``paddle.distributed.communication.group.Group`` with ``.ranks``
(global ranks, sorted), ``.nranks``, ``.rank`` (this rank's index in the group, -1 if absent), ``.id``):

    ============  ====================================  ==============================  ======================================
    axis          group                                 my index                        size
    ============  ====================================  ==============================  ======================================
    model (mp)    get_model_parallel_group()            get_model_parallel_rank()       get_model_parallel_world_size()
    pipe (pp)     get_pipe_parallel_group()             get_stage_id()                  get_pipe_parallel_world_size()
    data (dp)     get_data_parallel_group()             get_data_parallel_rank()        get_data_parallel_world_size()
    sharding      get_sharding_parallel_group()         get_sharding_parallel_rank()    get_sharding_parallel_world_size()
    sep           get_sep_parallel_group() (*)          get_sep_parallel_rank()         get_sep_parallel_world_size()
    ============  ====================================  ==============================  ======================================

(*) asserts sep > 1. An axis of degree 1 still has a one-rank group (``.ranks == [me]``, no process
group behind it): with dp4, ``get_model_parallel_group().ranks == [r]`` and the dp group is [0,1,2,3].
Also: ``get_*_group_src_rank()`` (global rank of index 0), ``hcg.is_first_stage`` / ``hcg.is_last_stage``,
``get_check_parallel_group()`` (the ranks with my "data" coordinate, i.e. one whole model replica
(pp x sharding x mp), used for global-norm / inf checks; ``sharding=True``: same along "sharding"),
``get_parallel_mode()``, ``hcg.global_rank``, ``hcg.nranks``, and the module global
``paddle.distributed.fleet.base.topology._HYBRID_PARALLEL_GROUP`` (what the mp layers read).
``fleet.get_hybrid_communicate_group()`` returns the same object.

Group-creation race (see CPU_CLUSTER.md). In 3.3.1 ``HybridCommunicateGroup.__init__`` calls
``paddle.distributed.new_group(...)`` through the package attribute (``topology.py`` does
``import paddle`` and has no ``new_group`` name of its own), once per group along every axis
(pipe, data, model, sharding, [sep], the "check" group(s) along data [and sharding]; every rank
creates every group, one-rank groups make no process group): 13 calls for mp2 x pp2, 14 for
dp2 x mp2, 15 for sharding2 x mp2, 17 for dp4. (The four-direction p2p groups are only made when
``_use_four_directions``; not by default.) The CPU_CLUSTER.md fix (a barrier after each creation) is
NOT enough: with it, mp2 x pp2 still failed in 2 of 4 launches (creating the 4-rank check group:
``address.cc:30 ... 136 vs 45`` once, a gloo TIMEOUT once); dp2 x mp2 passed 3 of 3. The cause and the
complete fix (a fresh TCPStore per group) are in ``gloo_safe_group_creation``; with it, 16 of 16
launches passed (mp2 x pp2 x6, dp2 x mp2 x3, sharding2 x mp2 x2, sharding2 x pp2, dp4 x2, mp4, pp4).
``init_fleet`` applies it only for the duration of ``fleet.init``, replacing the ``new_group``
attribute of every loaded module that holds the original function (``paddle.distributed``,
``paddle.distributed.collective``, any ``from paddle.distributed import new_group`` importer; and
``topology.new_group`` if a Paddle version has one) and restoring them afterwards (also in
modules first imported during ``fleet.init`` that captured the wrapper). Groups a test creates
later need ``with gloo_safe_group_creation(): ...`` around the ``new_group`` calls.

Sharded state dicts. ``TinyParallelLlama`` is built from Paddle's ``VocabParallelEmbedding``
(weight [vocab/mp, hidden], split axis 0), ``ColumnParallelLinear`` (weight [in, out/mp], axis 1),
``RowParallelLinear`` (weight [in/mp, out], axis 0): Paddle's [in, out] Linear layout, NOT the HF
[out, in] layout. ``model.sharded_state_dict()`` (the plain ``Layer`` recursion plus the mp layers'
overrides) yields the right keys, ``local_shape``, ``global_shape`` and ``global_offset`` for mp, pp
(global layer indices, via a ``LayerDict`` keyed "2", "3", ...), dp and sharding stage 1 (parameters are
replicated over dp and sharding: identical entries on those ranks). Offsets there are computed as
``group.rank * local_shape[axis]`` of the mp group. ``sharded_state_dict(model)`` below builds the same
dict independently from the harness's own layout table (global shape, split axis, mp rank), so
that tests can check Paddle's dict against it (``compare_sharded_state_dicts``) and so that
``perturb`` does not depend on the code under test.

Values. ``perturb`` writes into each parameter in place (``set_value``; same storage, so
ShardedWeights taken before still see the new values) the slice of ``expected_global`` at the
parameter's global offset. Every value has the form +-(128..255) * 2**(-19..-4), exactly
representable in float32, bfloat16 and float16, so casting the model (or the export) to any of
those keeps checks bit-exact; 4096 distinct values from a 64-bit hash of (name, step, global flat
index), so a misplaced or transposed block is caught.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AXIS_ORDER = ("data", "pipe", "sharding", "sep", "context", "model")

# ----------------------------------------------------------------------------------------------
# fleet.init with the gloo group-creation fix
# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_safe_group_creation(fresh_store=True, timeout=300):
    """Make ``paddle.distributed.new_group`` safe on CPU/gloo while the block runs, then restore it.

    Replaces ``new_group`` in every loaded module holding the original (``paddle.distributed``,
    ``paddle.distributed.collective``, ...; ``fleet.base.topology`` calls it as
    ``paddle.distributed.new_group``) with a wrapper that

    1. (``fresh_store``) gives the group its own new TCPStore for gloo's rendezvous. Why: in 3.3.1
       ``ProcessGroupGloo``'s constructor runs ``gloo::rendezvous::Context::connectFullMesh`` on the
       GLOBAL store WITHOUT a prefix (only the CommContext it also creates is prefixed by the group
       id), so every group writes its pair addresses under the keys "0", "1", ... (local ranks). A
       member that reads key "i" before local rank i of the new group has written it gets the
       stale value of an earlier group (the global group, or a group of another size): "Connection
       refused", a hang in ``waitUntilConnected``, or ``address.cc:30 sizeof(impl_) == bytes.size().
       136 vs 45`` (a 1-address value of a 2-rank group read by a 4-rank group: 136/3 = 45). A
       barrier after each creation (the CPU_CLUSTER.md fix) does not remove stale keys; it failed
       on the 4-rank "check" group of mp2 x pp2. Rank 0 starts a TCPStore server on a free port,
       publishes the port in the global store under a unique key, and every rank connects to it;
       ``collective._default_store`` points to it for the one ``new_group`` call.
    2. calls ``dist.barrier()`` after each creation (the fix from CPU_CLUSTER.md).

    Every rank must make the same sequence of ``new_group`` calls (Paddle requires that anyway).
    Stores are kept alive for the life of the process (the groups hold them).
    """
    import paddle.distributed as dist
    import paddle.distributed.collective as collective
    import paddle.distributed.fleet.base.topology as topology
    from paddle.base import core

    original = collective.new_group
    barrier = dist.barrier
    created = []

    def new_group_safe(ranks=None, *args, **kwargs):
        n_members = dist.get_world_size() if ranks is None else len(set(ranks))
        swapped = None
        if fresh_store and n_members > 1:
            _STORES_COUNTER[0] += 1
            key = f"pfc_harness/group_store/{_STORES_COUNTER[0]}"
            gstore = collective._default_store
            world, rank = dist.get_world_size(), dist.get_rank()
            host = os.environ.get("PADDLE_MASTER", "127.0.0.1:0").rsplit(":", 1)[0] or "127.0.0.1"
            if rank == 0:
                port = _free_port()
                gstore.set(key, str(port))
            else:
                gstore.wait(key)
                raw = gstore.get(key)
                port = int(bytes(raw).decode() if not isinstance(raw, str) else raw)
            # the master waits in its constructor until all `world` ranks have connected
            store = core.TCPStore(host, port, rank == 0, world, timeout)
            _STORES.append(store)
            swapped = gstore
            collective._default_store = store
        try:
            group = original(ranks, *args, **kwargs)
        finally:
            if swapped is not None:
                collective._default_store = swapped
        barrier()
        created.append(list(getattr(group, "ranks", []) or []))
        return group

    new_group_safe.created = created  # for diagnostics
    for mod in list(sys.modules.values()):
        try:
            if mod is not None and mod.__dict__.get("new_group") is original:
                setattr(mod, "new_group", new_group_safe)
        except Exception:  # exotic module objects
            continue
    if getattr(topology, "new_group", None) is original:  # not present in 3.3.1; kept for other versions
        topology.new_group = new_group_safe
    try:
        yield new_group_safe
    finally:
        # also sweeps modules first imported inside the block that captured the wrapper
        for mod in list(sys.modules.values()):
            try:
                if mod is not None and mod.__dict__.get("new_group") is new_group_safe:
                    setattr(mod, "new_group", original)
            except Exception:
                continue


_STORES: list = []
_STORES_COUNTER = [0]
barrier_after_new_group = gloo_safe_group_creation  # the name used in CPU_CLUSTER.md's description


_STATE: dict = {}


def init_fleet(dp=1, mp=1, pp=1, sharding=1, sep=1, sharding_stage=1, seed=0, fresh_store=None, device="cpu"):
    """``fleet.init(is_collective=True)`` with ``hybrid_configs`` for these degrees (axis order the
    default ["data", "pipe", "sharding", "sep", "context", "model"]), applying the gloo
    group-creation fix only for the duration of ``fleet.init``. Returns the HybridCommunicateGroup.

    ``sharding_stage`` is not a ``fleet.init`` setting (the stage is chosen when the optimizer is
    wrapped); it is recorded in ``harness_config()`` for the tests. For parameters, sharding stage 1
    means replication over the sharding axis, like dp. ``seed`` seeds paddle, numpy and the
    tensor-parallel init seed (``tensor_parallel_configs["tensor_init_seed"]``). ``fresh_store``
    (default: env ``PFC_HARNESS_FRESH_STORE``, "1") selects the full fix of
    ``gloo_safe_group_creation``; ``False`` leaves only the barriers (for diagnostics).
    """
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if dp * mp * pp * sharding * sep != world:
        raise ValueError(f"dp*mp*pp*sharding*sep = {dp * mp * pp * sharding * sep} != world size {world}")
    paddle.set_device(device)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": dp,
        "mp_degree": mp,
        "pp_degree": pp,
        "sharding_degree": sharding,
        "sep_degree": sep,
    }
    if pp > 1:
        strategy.pipeline_configs = {"accumulate_steps": 1, "micro_batch_size": 1}
    strategy.tensor_parallel_configs = {"tensor_init_seed": seed}
    t0 = time.perf_counter()
    if fresh_store is None:
        fresh_store = os.environ.get("PFC_HARNESS_FRESH_STORE", "1") != "0"
    if device == "cpu":
        with gloo_safe_group_creation(fresh_store=fresh_store) as wrapper:
            fleet.init(is_collective=True, strategy=strategy)
    else:
        wrapper = types.SimpleNamespace(created=[])
        fleet.init(is_collective=True, strategy=strategy)
    _STATE.update(
        degrees=dict(dp=dp, mp=mp, pp=pp, sharding=sharding, sep=sep),
        sharding_stage=sharding_stage,
        seed=seed,
        fresh_store=fresh_store,
        groups_created=len(wrapper.created),
        fleet_init_seconds=time.perf_counter() - t0,
    )
    paddle.seed(seed)
    np.random.seed(seed)
    assert dist.get_world_size() == world
    return fleet.get_hybrid_communicate_group()


def device_peak(fn):
    """``(fn(), peak)``: ``peak`` is the most device memory Paddle's allocator held while ``fn`` ran, minus
    what it held before (the export's own device memory); None when the current place is the CPU."""
    import paddle

    place = paddle.framework._current_expected_place()
    if place.is_cpu_place():
        return fn(), None
    name = f"{paddle.device.get_device().split(':')[0]}:{place.get_device_id()}"
    paddle.device.synchronize()
    paddle.device.reset_max_memory_allocated(name)
    before = paddle.device.memory_allocated(name)
    result = fn()
    return result, paddle.device.max_memory_allocated(name) - before


def harness_config() -> dict:
    """What ``init_fleet`` was called with, plus how many groups it created and how long it took."""
    return dict(_STATE)


def rank_info(hcg) -> dict:
    """JSON-able description of this rank: coordinates and the global ranks of its groups."""
    topo = hcg.topology()
    rank = hcg.get_global_rank()

    def ranks(g):
        return None if g is None else list(g.ranks)

    return {
        "rank": rank,
        "axis_order": list(topo.get_hybrid_group_names()),
        "coords": dict(topo.get_coord(rank)._asdict()),
        "mp": ranks(hcg.get_model_parallel_group()),
        "pp": ranks(hcg.get_pipe_parallel_group()),
        "dp": ranks(hcg.get_data_parallel_group()),
        "sharding": ranks(hcg.get_sharding_parallel_group()),
        "sep": ranks(hcg.get_sep_parallel_group()) if hcg.get_sep_parallel_world_size() > 1 else None,
        "mp_rank": hcg.get_model_parallel_rank(),
        "stage": hcg.get_stage_id(),
        "dp_rank": hcg.get_data_parallel_rank(),
        "sharding_rank": hcg.get_sharding_parallel_rank(),
    }


# ----------------------------------------------------------------------------------------------
# The tiny tensor-parallel Llama
# ----------------------------------------------------------------------------------------------


@dataclass
class ParamSpec:
    """Harness-side layout of one parameter: where the local shard sits in the global tensor."""

    key: str
    param: object  # paddle Parameter (the local shard)
    global_shape: tuple
    split_axis: int | None  # None: replicated across mp
    mp_rank: int
    mp_size: int

    @property
    def local_shape(self) -> tuple:
        return tuple(int(d) for d in self.param.shape)

    @property
    def global_offset(self) -> tuple:
        off = [0] * len(self.global_shape)
        if self.split_axis is not None:
            off[self.split_axis] = self.mp_rank * (self.global_shape[self.split_axis] // self.mp_size)
        return tuple(off)


def global_param_shapes(vocab=64, hidden=16, inter=32, layers=4, heads=4, kv_heads=2) -> dict:
    """{global key: global shape (Paddle [in, out] layout for Linear weights)} of the whole model,
    the same on every rank and without building anything."""
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (hidden, heads * hd),
                p + "self_attn.k_proj.weight": (hidden, kv_heads * hd),
                p + "self_attn.v_proj.weight": (hidden, kv_heads * hd),
                p + "self_attn.o_proj.weight": (heads * hd, hidden),
                p + "mlp.gate_proj.weight": (hidden, inter),
                p + "mlp.up_proj.weight": (hidden, inter),
                p + "mlp.down_proj.weight": (inter, hidden),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (hidden, vocab)
    return shapes


def stage_layers(layers: int, pp: int, stage: int) -> list:
    """Global indices of the decoder layers held by pipeline stage ``stage`` (contiguous split;
    the first ``layers % pp`` stages get one extra)."""
    bounds = np.cumsum([0] + [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)])
    return list(range(int(bounds[stage]), int(bounds[stage + 1])))


def _build_model_classes():
    import paddle
    from paddle import nn
    from paddle.distributed.fleet.meta_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    class RMSNormWeight(nn.Layer):
        def __init__(self, hidden):
            super().__init__()
            self.weight = self.create_parameter(
                shape=[hidden], dtype=paddle.get_default_dtype(),
                default_initializer=nn.initializer.Constant(1.0),
            )

    class Attention(nn.Layer):
        def __init__(self, hidden, heads, kv_heads):
            super().__init__()
            hd = hidden // heads
            self.q_proj = ColumnParallelLinear(hidden, heads * hd, has_bias=False, gather_output=False)
            self.k_proj = ColumnParallelLinear(hidden, kv_heads * hd, has_bias=False, gather_output=False)
            self.v_proj = ColumnParallelLinear(hidden, kv_heads * hd, has_bias=False, gather_output=False)
            self.o_proj = RowParallelLinear(heads * hd, hidden, has_bias=False, input_is_parallel=True)

    class MLP(nn.Layer):
        def __init__(self, hidden, inter):
            super().__init__()
            self.gate_proj = ColumnParallelLinear(hidden, inter, has_bias=False, gather_output=False)
            self.up_proj = ColumnParallelLinear(hidden, inter, has_bias=False, gather_output=False)
            self.down_proj = RowParallelLinear(inter, hidden, has_bias=False, input_is_parallel=True)

    class DecoderLayer(nn.Layer):
        def __init__(self, hidden, inter, heads, kv_heads):
            super().__init__()
            self.self_attn = Attention(hidden, heads, kv_heads)
            self.mlp = MLP(hidden, inter)
            self.input_layernorm = RMSNormWeight(hidden)
            self.post_attention_layernorm = RMSNormWeight(hidden)

    class Inner(nn.Layer):
        def __init__(self, vocab, hidden, inter, heads, kv_heads, my_layers, first, last):
            super().__init__()
            if first:
                self.embed_tokens = VocabParallelEmbedding(vocab, hidden)
            # keyed by GLOBAL layer index, so names are model.layers.<global i>.*
            self.layers = nn.LayerDict({str(i): DecoderLayer(hidden, inter, heads, kv_heads) for i in my_layers})
            if last:
                self.norm = RMSNormWeight(hidden)

    class TinyParallelLlama(nn.Layer):
        """Llama-shaped parameter container built from Paddle's tensor-parallel layers (no forward).

        On pipeline stage s it holds only that stage's decoder layers (``stage_layers``), the
        embedding on stage 0, ``norm`` and ``lm_head`` on the last stage; names are global.
        ``self.param_specs``: {key: ParamSpec} for the local parameters; ``self.dims``: the sizes.
        """

        def __init__(self, vocab=64, hidden=16, inter=32, layers=4, heads=4, kv_heads=2, hcg=None):
            super().__init__()
            if hcg is None:
                from paddle.distributed import fleet

                hcg = fleet.get_hybrid_communicate_group()
            self.dims = dict(vocab=vocab, hidden=hidden, inter=inter, layers=layers, heads=heads, kv_heads=kv_heads)
            pp, stage = hcg.get_pipe_parallel_world_size(), hcg.get_stage_id()
            self.stage, self.num_stages = stage, pp
            self.layer_ids = stage_layers(layers, pp, stage)
            first, last = stage == 0, stage == pp - 1
            self.model = Inner(vocab, hidden, inter, heads, kv_heads, self.layer_ids, first, last)
            if last:
                self.lm_head = ColumnParallelLinear(hidden, vocab, has_bias=False, gather_output=True)

            mp_rank, mp_size = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
            shapes = global_param_shapes(**self.dims)
            axis_of = {
                VocabParallelEmbedding: 0,
                ColumnParallelLinear: 1,
                RowParallelLinear: 0,
                RMSNormWeight: None,
            }
            self.param_specs = {}
            for lname, layer in self.named_sublayers():
                if type(layer) not in axis_of:
                    continue
                key = f"{lname}.weight"
                axis = axis_of[type(layer)]
                spec = ParamSpec(key, layer.weight, tuple(shapes[key]), axis, mp_rank, mp_size)
                expect_local = list(spec.global_shape)
                if axis is not None:
                    assert expect_local[axis] % mp_size == 0, (key, expect_local, mp_size)
                    expect_local[axis] //= mp_size
                assert spec.local_shape == tuple(expect_local), (key, spec.local_shape, expect_local)
                self.param_specs[key] = spec
            assert set(self.param_specs) == set(dict(self.named_parameters())), "layout table incomplete"

    return TinyParallelLlama


_CLASSES = {}


def TinyParallelLlama(vocab=64, hidden=16, inter=32, layers=4, heads=4, kv_heads=2, hcg=None):
    """Build the model (classes are created lazily so that importing this module needs no paddle)."""
    if "TinyParallelLlama" not in _CLASSES:
        _CLASSES["TinyParallelLlama"] = _build_model_classes()
    return _CLASSES["TinyParallelLlama"](vocab, hidden, inter, layers, heads, kv_heads, hcg)


def sharded_state_dict(model) -> dict:
    """{key: ShardedWeight} built from the harness's own layout table (not from Paddle's
    ``Layer.sharded_state_dict``). In 3.3.1 both agree for every topology probed (mp, pp, dp,
    sharding stage 1); use this one as the reference."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    return {
        k: ShardedWeight(k, s.param, s.local_shape, s.global_shape, s.global_offset)
        for k, s in model.param_specs.items()
    }


def compare_sharded_state_dicts(got: dict, ref: dict) -> list:
    """Differences (keys, local/global shape, offset, tensor identity) between two sharded state dicts."""
    problems = []
    for k in sorted(set(got) ^ set(ref)):
        problems.append(f"key {k!r} only in {'got' if k in got else 'ref'}")
    for k in sorted(set(got) & set(ref)):
        a, b = got[k], ref[k]
        for attr in ("key", "local_shape", "global_shape", "global_offset"):
            va, vb = getattr(a, attr), getattr(b, attr)
            if attr != "key":
                va, vb = tuple(int(x) for x in va), tuple(int(x) for x in vb)
            if va != vb:
                problems.append(f"{k}: {attr} {va} != {vb}")
        if a.local_tensor.data_ptr() != b.local_tensor.data_ptr():
            problems.append(f"{k}: local_tensor is a different storage")
        if getattr(a, "is_flattened", False) != getattr(b, "is_flattened", False):
            problems.append(f"{k}: is_flattened differs")
    return problems


# ----------------------------------------------------------------------------------------------
# Deterministic values
# ----------------------------------------------------------------------------------------------


def _seed(name: str, step: int) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.sha256(f"{name}|{int(step)}".encode()).digest()[:8], "little"))


def _values_at(name: str, step: int, flat_index: np.ndarray) -> np.ndarray:
    """float32 value of each global flat index (splitmix64 of seed ^ index*golden)."""
    with np.errstate(over="ignore"):
        z = flat_index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ _seed(name, step)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    sign = 1.0 - 2.0 * (z & np.uint64(1)).astype(np.float64)
    mant = 128.0 + ((z >> np.uint64(1)) & np.uint64(127)).astype(np.float64)
    exp = ((z >> np.uint64(8)) & np.uint64(15)).astype(np.int64) - 19
    return np.ldexp(sign * mant, exp).astype(np.float32)


def _global_flat_index(global_shape, global_offset, local_shape) -> np.ndarray:
    """Global C-order flat index of every element of the block (shape ``local_shape``)."""
    global_shape = tuple(int(d) for d in global_shape)
    idx = np.zeros(tuple(int(d) for d in local_shape), dtype=np.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        r = np.arange(int(global_offset[d]), int(global_offset[d]) + int(local_shape[d]), dtype=np.int64)
        shape = [1] * len(global_shape)
        shape[d] = -1
        idx = idx + (r * stride).reshape(shape)
        stride *= global_shape[d]
    return idx


def _to_dtype(values_f32: np.ndarray, dtype: str) -> np.ndarray:
    """Exact conversion of harness values: float32 / float16 arrays, bfloat16 as uint16 bits."""
    if dtype == "float32":
        return values_f32
    if dtype == "float16":
        return values_f32.astype(np.float16)
    if dtype == "bfloat16":
        bits = values_f32.view(np.uint32)
        assert not np.any(bits & np.uint32(0xFFFF)), "value not representable in bfloat16"
        return (bits >> np.uint32(16)).astype(np.uint16)
    raise ValueError(f"unsupported dtype {dtype}")


def expected_block(name, global_shape, global_offset, local_shape, step, dtype="float32") -> np.ndarray:
    """The block of ``expected_global(name, global_shape, step, dtype)`` at ``global_offset``."""
    return _to_dtype(_values_at(name, step, _global_flat_index(global_shape, global_offset, local_shape)), dtype)


def expected_global(name, global_shape, step, dtype="float32") -> np.ndarray:
    """The full tensor every rank's shard of ``name`` is a slice of after ``perturb(model, step)``.
    float32 -> np.float32, float16 -> np.float16, bfloat16 -> np.uint16 bit patterns."""
    shape = tuple(int(d) for d in global_shape)
    return expected_block(name, shape, (0,) * len(shape), shape, step, dtype)


def perturb(model, step) -> None:
    """Overwrite every local parameter in place with its slice of ``expected_global(key, .., step)``,
    using the harness's layout table (global shape, split axis, mp rank), as an optimizer step would."""
    import paddle

    for key, spec in model.param_specs.items():
        vals = expected_block(key, spec.global_shape, spec.global_offset, spec.local_shape, step)
        p = spec.param
        t = paddle.to_tensor(vals)
        if p.dtype != t.dtype:
            t = t.astype(p.dtype)
        p.set_value(t)


# ----------------------------------------------------------------------------------------------
# Dumps of shards and their numpy reassembly
# ----------------------------------------------------------------------------------------------

_DTYPE_NP = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "bfloat16": np.uint16,  # bit patterns
    "int64": np.int64,
    "int32": np.int32,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def dtype_name(t) -> str:
    """'float32', 'bfloat16', ... of a paddle tensor."""
    return str(t.dtype).replace("paddle.", "")


def np_storage_dtype(name: str):
    """numpy dtype used to hold a paddle dtype (bfloat16 -> uint16 bits)."""
    return np.dtype(_DTYPE_NP[name])


def tensor_to_numpy_bits(t) -> np.ndarray:
    """A numpy copy of a paddle tensor with the same bytes (bfloat16 -> uint16)."""
    import paddle

    if dtype_name(t) == "bfloat16":
        t = t.view(paddle.uint16)
    return np.ascontiguousarray(t.numpy())


def dump_shards(sd: dict, path) -> str:
    """Write this rank's shards of ``sd`` ({key: ShardedWeight}) as a pickle-free ``.npz``.

    ``path``: a directory (the file is ``<path>/shards-rank<NNNNN>.npz``, rank from
    ``paddle.distributed.get_rank()``) or a file name ending in ``.npz``. Each shard is one uint8
    array of its raw bytes (``data_<i>``); ``meta`` holds a JSON list of
    {key, local_shape, global_shape, global_offset, dtype, nbytes, flattened_range}. Written to a temp
    name and renamed. Returns the file name."""
    import paddle.distributed as dist

    path = Path(path)
    if path.suffix != ".npz":
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"shards-rank{dist.get_rank():05d}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, meta = {}, []
    for i, (key, sw) in enumerate(sd.items()):
        raw = tensor_to_numpy_bits(sw.local_tensor)
        fr = getattr(sw, "flattened_range", None)
        flattened = bool(getattr(sw, "is_flattened", False)) or fr is not None
        if flattened:
            fr = fr or slice(0, int(np.prod(sw.local_shape)))
            raw = raw.reshape(-1)
            if raw.size != fr.stop - fr.start:  # local_tensor holds the whole flat block
                raw = raw[fr.start : fr.stop]
        else:
            assert tuple(raw.shape) == tuple(int(d) for d in sw.local_shape), (key, raw.shape, sw.local_shape)
        arrays[f"data_{i}"] = np.frombuffer(raw.tobytes(), dtype=np.uint8)
        meta.append(
            {
                "key": sw.key if sw.key else key,
                "local_shape": [int(d) for d in sw.local_shape],
                "global_shape": [int(d) for d in sw.global_shape],
                "global_offset": [int(d) for d in sw.global_offset],
                "dtype": dtype_name(sw.local_tensor),
                "nbytes": int(arrays[f"data_{i}"].size),
                "flattened_range": [int(fr.start), int(fr.stop)] if flattened else None,
            }
        )
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return str(path)


def load_dump(file) -> list:
    """[(meta dict, raw uint8 array)] of one dump file."""
    with np.load(file, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        return [(m, z[f"data_{i}"]) for i, m in enumerate(meta)]


def reassemble(dump_dir, return_coverage=False) -> dict:
    """{key: np.ndarray} rebuilt from every ``*.npz`` dump in ``dump_dir`` with plain numpy
    (bfloat16 as uint16 bits). Raises AssertionError if shards disagree on global shape or dtype,
    if overlapping shards (replicas over dp / sharding / pp-replicated pieces) differ in any byte,
    or if some element is covered by no shard. With ``return_coverage`` also returns
    {key: number of shards that contributed}."""
    files = sorted(Path(dump_dir).glob("*.npz"))
    assert files, f"no dumps in {dump_dir}"
    out, covered, count, info = {}, {}, {}, {}
    for f in files:
        for m, raw in load_dump(f):
            key = m["key"]
            gshape, dtype = tuple(m["global_shape"]), m["dtype"]
            npd = np_storage_dtype(dtype)
            if key not in out:
                out[key] = np.zeros(gshape, dtype=npd)
                covered[key] = np.zeros(gshape, dtype=bool)
                count[key] = 0
                info[key] = (gshape, dtype, f.name)
            assert info[key][:2] == (gshape, dtype), (
                f"{key}: {f.name} says {gshape}/{dtype}, {info[key][2]} said {info[key][:2]}"
            )
            vals = raw.view(npd)
            off, lshape = m["global_offset"], m["local_shape"]
            assert all(o + l <= g for o, l, g in zip(off, lshape, gshape)), f"{key}: block outside tensor in {f.name}"
            if m["flattened_range"] is None:
                assert vals.size == int(np.prod(lshape)), f"{key}: {vals.size} values for local shape {lshape}"
                sl = tuple(slice(o, o + l) for o, l in zip(off, lshape))
                tgt, cov = out[key][sl], covered[key][sl]
                vals = vals.reshape(lshape)
                prev_mask = cov.copy()
                # bitwise comparison (NaN, -0.0 safe) where already covered
                if prev_mask.any():
                    a = tgt[prev_mask].view(np.uint8)
                    b = vals[prev_mask].view(np.uint8)
                    assert np.array_equal(a, b), f"{key}: overlapping shards differ ({f.name}, offset {off})"
                tgt[...] = vals
                cov[...] = True
            else:
                start, stop = m["flattened_range"]
                idx = _global_flat_index(gshape, off, lshape).reshape(-1)[start:stop]
                assert vals.size == idx.size, f"{key}: {vals.size} values for flattened range {start}:{stop}"
                flat, cflat = out[key].reshape(-1), covered[key].reshape(-1)
                prev = cflat[idx]
                if prev.any():
                    assert np.array_equal(flat[idx][prev].view(np.uint8), vals[prev].view(np.uint8)), (
                        f"{key}: overlapping flattened shards differ ({f.name})"
                    )
                flat[idx] = vals
                cflat[idx] = True
            count[key] += 1
    for key, cov in covered.items():
        missing = int(cov.size - cov.sum())
        assert missing == 0, f"{key}: {missing} of {cov.size} elements covered by no shard"
    return (out, count) if return_coverage else out


# ----------------------------------------------------------------------------------------------
# Running a launch from a test (outside the ranks)
# ----------------------------------------------------------------------------------------------


@dataclass
class LaunchResult:
    rc: int  # launcher exit code; -9/-15 or 124-like values after a timeout kill
    timed_out: bool
    seconds: float
    log_dir: str
    output: str  # the launcher's own stdout+stderr
    logs: dict  # {rank: text of workerlog.<rank>}

    def tagged(self, tag: str) -> list:
        """[(rank, parsed JSON)] of every line ``<tag> {json}`` in the rank logs, by rank."""
        out = []
        for rank in sorted(self.logs):
            for line in self.logs[rank].splitlines():
                if line.startswith(tag + " "):
                    out.append((rank, json.loads(line[len(tag) + 1 :])))
        return out

    def describe(self) -> str:
        """Launcher output and the tail of each rank log, for assertion messages."""
        parts = [f"rc={self.rc} timed_out={self.timed_out} {self.seconds:.1f}s", self.output[-2000:]]
        for rank in sorted(self.logs):
            parts.append(f"--- workerlog.{rank} (tail)\n" + self.logs[rank][-3000:])
        return "\n".join(parts)


# Paddle 3.3.1's TCPStore on rank 0 sometimes aborts as it starts its libuv server, before any user code past
# fleet.init runs (about 1 launch in 20 under load: "uv__finish_close: Assertion ... UV_HANDLE_CLOSING failed",
# exit -6): the launch is retried once, in a fresh log folder. Every other failure is returned as it is.
STORE_ABORT = "uv__finish_close"


def store_aborted(result: LaunchResult) -> bool:
    """Whether a launch died of Paddle's TCPStore abort (launcher output or any rank log)."""
    return STORE_ABORT in result.output or any(STORE_ABORT in text for text in result.logs.values())


def run_launch(script, args=(), nproc=4, log_dir=None, timeout=300, python=None, env=None,
               devices=None) -> LaunchResult:
    """``python -m paddle.distributed.launch --nproc_per_node N --log_dir LOG script args`` in its own
    session; on timeout the whole process group (launcher and ranks) is killed (SIGTERM, then
    SIGKILL). Per-rank output is read from ``LOG/workerlog.<rank>``. Retried once (in ``LOG-retry``) when
    Paddle's TCPStore aborts at start (``store_aborted``).

    ``devices`` (device ids) adds ``--devices 0,1,...``: for an accelerator, rank i gets the i-th
    (``tests/_fake_device.py``'s ``launch`` passes it with the fake accelerator's environment: the
    launcher picks a custom device type whenever ``CUSTOM_DEVICE_ROOT`` loads one)."""
    import tempfile

    log_dir = str(log_dir or tempfile.mkdtemp(prefix="pfc_launch_"))
    device_args = ["--devices", ",".join(str(d) for d in devices)] if devices is not None else []
    for attempt_dir in (log_dir, log_dir + "-retry"):
        cmd = [python or sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               *device_args, "--log_dir", attempt_dir, str(script), *[str(a) for a in args]]
        result = _launch_once(cmd, attempt_dir, timeout, env)
        if not store_aborted(result):
            break
    return result


def _launch_once(cmd: list, log_dir: str, timeout: float, env) -> LaunchResult:
    import signal
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                output, _ = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                output = ""
    seconds = time.perf_counter() - t0
    logs = {}
    for f in Path(log_dir).glob("workerlog.*"):
        suffix = f.name.split(".", 1)[1]
        if suffix.isdigit():
            logs[int(suffix)] = f.read_text(errors="replace")
    return LaunchResult(proc.returncode, timed_out, seconds, log_dir, output or "", logs)
