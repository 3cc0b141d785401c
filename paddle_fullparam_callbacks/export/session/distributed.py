"""The communication an export needs beyond the assembler: a small context object.

``DistContext`` carries this rank's place in the topology plan and the export's own host groups
created at ``on_train_begin`` (``trainer/host_groups.py``); ``LocalContext`` is the single-process
stand-in with the same interface, so one export flow serves both.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, List

from ...plan.topology import Mesh, TopologyPlan, plan_topology


@dataclass
class LocalContext:
    """A world of one rank: every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    coordinator: int = 0
    topology: TopologyPlan = field(default_factory=lambda: plan_topology([("data", 1)]))
    h_group: Any = None
    v_group: Any = None
    nodes: tuple = ()  # rank -> the index of its node (the launcher's pod), numbered by first rank; () = one node
    watchdog: Any = None  # export.timeout_s: a Watchdog wrapping every collective (several ranks only)

    @property
    def mesh(self) -> Mesh:
        return self.topology.mesh_of(self.rank)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def all_gather_object(self, obj, group=None, what: str = "exchange") -> List[Any]:
        return [obj]

    def mesh_gather_object(self, obj, what: str = "mesh exchange") -> List[Any]:
        return [obj]

    def waiting(self, what: str, peers=None):
        """Context manager around a collective: watched by the watchdog when there is one."""
        return self.watchdog.waiting(what, peers) if self.watchdog is not None else nullcontext()

    @property
    def mesh_ranks(self) -> List[int]:
        return [r for row in self.mesh.rows for r in row]

    def barrier(self) -> None:
        pass


@dataclass
class DistContext(LocalContext):
    """A rank of a multi-rank job. ``world_group``, ``h_group``, ``v_group``: the export's own host
    groups (``assemble.host_group.HostGroup``): the whole job, this rank's mesh row and column (None
    where the mesh has a single column/row)."""

    world_group: Any = None
    pair_groups: Any = None  # the routed schedule's transfers: a two-rank group per peer (trainer/host_groups.py)
    # Paddle's own mp / pp groups (even of one rank), for assembler=paddle, whose HV path needs both
    paddle_h_group: Any = None
    paddle_v_group: Any = None

    def all_gather_object(self, obj, group=None, what: str = "exchange") -> List[Any]:
        group = group if group is not None else self.world_group
        with self.waiting(what, None if group is self.world_group else self.mesh_ranks):
            return group.all_gather_object(obj)

    def mesh_gather_object(self, obj, what: str = "mesh exchange") -> List[Any]:
        """Every mesh rank's object, rows (pipe) outer, columns inner: the same list on each rank."""
        row = [obj] if self.h_group is None else self.all_gather_object(obj, self.h_group, what)
        if self.v_group is None:
            return row
        return [x for r in self.all_gather_object(row, self.v_group, what) for x in r]

    def barrier(self) -> None:
        with self.waiting("barrier"):
            self.world_group.barrier()
