"""From the live job to a :class:`DistContext`: axes, sharding stage, mesh groups.

The export talks over gloo groups of its own (``host_groups.py``): the world and each mesh's rows
and columns, created here, collectively, in one fixed order on every rank. Paddle's
``HybridCommunicateGroup`` is read for the job's axes, and its tensor-parallel and pipeline groups
are checked against the plan's rows and columns. This runs at ``on_train_begin``, never inside an
export.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from ..export.session.distributed import DistContext, LocalContext
from ..models.fleet import model_config
from ..plan.topology import TopologyPlan, plan_topology
from .host_groups import PairGroups, create_host_groups

logger = logging.getLogger("paddle_fullparam_callbacks")


def _hcg():
    try:
        from paddle.distributed import fleet

        return fleet.get_hybrid_communicate_group()
    except Exception:  # fleet not initialised: plain data parallelism
        return None


def sharding_stage_of(args) -> int:
    """The sharding stage from TrainingArguments (``sharding="stage1"``, ["stage2", ...]); 1 if none."""
    value = getattr(args, "sharding", None) if args is not None else None
    if not value:
        return 1
    items = value if isinstance(value, (list, tuple)) else str(value).split()
    stages = [int(str(s).lower().replace("stage", "")) for s in items if str(s).lower().startswith("stage")]
    stage = max(stages) if stages else 1
    # ShardingOption enums in PaddleFormers print as e.g. ShardingOption.SHARD_OP
    text = " ".join(str(i) for i in items).upper()
    if "FULL_SHARD" in text:
        stage = 3
    elif "SHARD_GRAD_OP" in text:
        stage = max(stage, 2)
    return stage


# PaddleFormers' moe_group (nn/moe/utils.py _parse_moe_group) -> the axes its experts are spread over
_MOE_GROUP_AXES = {"data": ("data",), "dp": ("data",), "mp": ("model",), "model": ("model",), "tp": ("model",),
                   "none": ("data", "pipe", "sharding", "sep", "context", "model"), "world": None, "all": None,
                   "dummy": ()}


def expert_axes_of(model) -> tuple:
    """The hybrid axes over which the model places different experts on different ranks (by its
    config's ``moe_group``); () for a dense model. The pipe axis is never one (stages hold
    different layers already)."""
    config = model_config(model)
    group = getattr(config, "moe_group_origin", None) or getattr(config, "moe_group", None)
    if not isinstance(group, str):
        return ()
    axes = _MOE_GROUP_AXES.get(group.lower(), ())
    if axes is None:  # every rank
        axes = _MOE_GROUP_AXES["none"]
    return tuple(a for a in axes if a != "pipe")


def axes_of_job(hcg, world_size: int) -> list:
    if hcg is None:
        return [("data", world_size)]
    topo = hcg.topology()
    names = topo.get_hybrid_group_names()
    axes = [(n, topo.get_dim(n)) for n in names]
    known = ("data", "pipe", "sharding", "sep", "context", "expert", "model")
    unsupported = [n for n, d in axes if d > 1 and n not in known]
    if unsupported:
        raise NotImplementedError(f"parallel axes {unsupported} are not supported by the exporter yet")
    return [(n, d) for n, d in axes if n in known]


def build_context(args=None, sharding_stage: Optional[int] = None, expert_axes: tuple = ()) -> "LocalContext | DistContext":
    """The export context of this rank; collective when groups must be created (all ranks call it).

    ``expert_axes``: see :func:`expert_axes_of` (the model's experts spread over these axes)."""
    import paddle.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return LocalContext()
    rank = dist.get_rank()
    hcg = _hcg()
    stage = sharding_stage if sharding_stage is not None else sharding_stage_of(args)
    axes = axes_of_job(hcg, world)
    present = {n for n, d in axes if d > 1}
    plan: TopologyPlan = plan_topology(axes, stage, [a for a in expert_axes if a in present])
    if plan.world_size != world:
        raise ValueError(f"the topology {plan.axes} has {plan.world_size} ranks but the job has {world}")
    mesh = plan.mesh_of(rank)
    h_ranks, v_ranks = list(mesh.h_ranks(rank)), list(mesh.v_ranks(rank))
    paddle_h = paddle_v = None
    if hcg is not None:
        # the job's own groups must be the plan's rows and columns (a check of our reading of the
        # topology); kept for assembler=paddle, which runs Paddle's full_param over them
        paddle_h, paddle_v = hcg.get_model_parallel_group(), hcg.get_pipe_parallel_group()
        if len(v_ranks) > 1:
            _check_same("pipeline", list(paddle_v.ranks), v_ranks)
        if len(h_ranks) > 1 and plan.horizontal_axes == ("model",):
            _check_same("tensor-parallel", list(paddle_h.ranks), h_ranks)
    groups = plan.export_groups()
    made = dict(zip(groups, create_host_groups(groups, rank)))
    ctx = DistContext(rank=rank, world_size=world, topology=plan, world_group=made[groups[0]],
                      h_group=made.get(tuple(h_ranks)) if len(h_ranks) > 1 else None,
                      v_group=made.get(tuple(v_ranks)) if len(v_ranks) > 1 else None)
    ctx.paddle_h_group, ctx.paddle_v_group = paddle_h, paddle_v
    ctx.pair_groups = PairGroups(rank, world)  # the routed schedule's transfers: a gloo group per pair, on demand
    ctx.nodes = node_indices(ctx.world_group.all_gather_object(node_identity()))
    return ctx


def node_identity() -> str:
    """This process's node as the launcher tells it: ``paddle.distributed.launch`` runs one pod per node
    (``POD_NAME``); else the host of this rank's endpoint; else the host name."""
    import socket

    pod = os.environ.get("POD_NAME")
    if pod:
        return f"pod:{pod}"
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    return f"host:{endpoint.rsplit(':', 1)[0]}" if ":" in endpoint else f"host:{socket.gethostname()}"


def node_indices(identities) -> tuple:
    """Each rank's node as a small number, nodes numbered in the order of their first rank.

    >>> node_indices(["pod:b", "pod:b", "pod:a", "pod:a"])
    (0, 0, 1, 1)
    """
    seen: dict = {}
    return tuple(seen.setdefault(x, len(seen)) for x in identities)


def _check_same(what: str, paddle_ranks, plan_ranks) -> None:
    if paddle_ranks != plan_ranks:
        raise ValueError(
            f"the job's {what} group is ranks {paddle_ranks} but the topology plan expects {plan_ranks}: "
            "the exporter's view of the hybrid topology does not match the job"
        )
