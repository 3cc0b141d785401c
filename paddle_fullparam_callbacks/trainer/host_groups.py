"""The export's own gloo process groups (host memory), created once per process at the start of a job.

An export talks over groups of its own (``assemble/host_group.py`` says why): the world, and each
mesh's rows and columns (``TopologyPlan.export_groups``). They are gloo groups whatever the job's
device backend (NCCL, XCCL, BKCL or gloo itself), so their collectives take host memory and never
wait behind training's work on a device stream. torch's asynchronous checkpointing makes a gloo
group for the same reason.

Each group gets a TCPStore of its own for gloo's rendezvous. Why not Paddle's
``new_group(ranks, backend="gloo")``: in Paddle 3.3.1 ``ProcessGroupGloo``'s constructor runs gloo's
``connectFullMesh`` on the store it is given *without a prefix*, so every gloo group made from the
job's global store writes its peers' addresses under the same keys ("0", "1", ...): a member can
read the address of an earlier group's peer (seen as "Connection refused", a hang in
``waitUntilConnected``, or ``address.cc:30 ... 136 vs 45``; ``tests/multirank/harness.py`` has the
measurements). A fresh store per group has no earlier keys. The group's first rank serves the store
on a free port and publishes ``host:port`` in the job's global store; the other members read it
there and connect. Groups are cached for the life of the process: a second ``train()`` in the same
job reuses them.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, List, Optional, Sequence, Tuple

from ..assemble.host_group import HostGroup

_GROUP_ID_BASE = 7_000_000  # far from Paddle's own ring ids (its comm contexts are keyed by them)
_TIMEOUT_S = 900
_cache: Dict[Tuple[int, ...], HostGroup] = {}
_created = [0]  # groups this process has walked through (the same count on every rank)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_host() -> str:
    """The address the other ranks reach this one at (the launcher's endpoint for this rank)."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else ""
    return host or "127.0.0.1"


def _text(value) -> str:
    return value if isinstance(value, str) else bytes(value).decode()


def create_host_groups(groups: Sequence[Sequence[int]], rank: int) -> List[Optional[HostGroup]]:
    """One ``HostGroup`` per entry of ``groups`` (global ranks in group order), None where this rank is
    not a member or the group has one rank. Collective: every rank of the job calls it with the same
    ``groups``, in the same order."""
    from paddle.base import core
    from paddle.distributed import collective

    job_store = getattr(collective, "_default_store", None)
    out: List[Optional[HostGroup]] = []
    for ranks in groups:
        ranks = tuple(int(r) for r in ranks)
        _created[0] += 1
        key = f"paddle_fullparam/export_group/{_created[0]}"
        if len(ranks) < 2 or rank not in ranks:
            out.append(None)
            continue
        if ranks in _cache:
            out.append(_cache[ranks])
            continue
        if job_store is None:
            raise RuntimeError("the job has no global store (paddle.distributed.init_parallel_env() was not called): "
                               "the export cannot create its process groups")
        if rank == ranks[0]:
            host, port = _my_host(), _free_port()
            job_store.set(key, f"{host}:{port}")
            store = core.TCPStore(host, port, True, len(ranks), _TIMEOUT_S)  # returns once every member connected
        else:
            job_store.wait(key)
            host, port = _text(job_store.get(key)).rsplit(":", 1)
            store = core.TCPStore(host, int(port), False, len(ranks), _TIMEOUT_S)
        pg = core.ProcessGroupGloo.create(store, ranks.index(rank), len(ranks), _GROUP_ID_BASE + _created[0])
        group = HostGroup(pg, ranks, rank)
        group.store = store  # the process group needs its store for its whole life
        _cache[ranks] = group
        out.append(group)
    return out
