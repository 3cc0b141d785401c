"""Adapter mode's names (``serve.adapter``): which names each engine loads a snapshot's adapter under, which it
unloads, and what it holds afterwards. Pure: the engine's calls are its protocol module's (``engines/``).

Every snapshot's adapter goes under the stable name (``serve.adapter_name``, loaded in place: clients keep
requesting it), and, with ``serve.keep_adapters: N``, under the snapshot's own name too, the N newest of those
kept and the older ones unloaded. :class:`Held` is what one engine holds, as far as the job knows; its
:meth:`~Held.kept` snapshots are what retention must keep on disk: vLLM 0.32 reads an adapter's directory again
after it was loaded (at each step while it is served in place, and whenever its cache evicted it), and a
directory gone by then kills its engine core (``engines/vllm.py``). The snapshot the stable name held before the
last swap stays too: requests that started on it carry its directory until they end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from ...config.serving import ADAPTER_DIRECTORY as DIRECTORY
from .engines import Adapter


def adapter_path(engine_snapshot_path: str) -> str:
    """The adapter's directory as the engine sees it, from the snapshot's.

    >>> adapter_path("/models/hf-step-000008/")
    '/models/hf-step-000008/adapter'
    """
    return f"{engine_snapshot_path.rstrip('/')}/{DIRECTORY}"


@dataclass
class Held:
    """What one engine holds: the snapshot under the stable name (or, for an adapter this job did not load, its
    directory), the one it held before the last swap, and the snapshots under their own names, oldest first."""

    stable: Optional[str] = None
    replaced: Optional[str] = None
    own: List[str] = field(default_factory=list)

    def kept(self) -> set:
        """The snapshots whose adapter directories the engine may still read."""
        return {n for n in (self.stable, self.replaced, *self.own) if n}

    def names(self, stable_name: str) -> Dict[str, str]:
        """{adapter name: the snapshot it serves}, for the record."""
        out = {stable_name: self.stable} if self.stable else {}
        out.update({n: n for n in self.own})
        return out


def plan(held: Held, snapshot: str, path: str, stable_name: str, keep: int) -> Adapter:
    """The load of ``snapshot``'s adapter (at ``path``, as the engine sees it) into an engine that holds ``held``.

    >>> a = plan(Held("hf-step-000004", None, ["hf-step-000002", "hf-step-000004"]), "hf-step-000006", "/m/6/adapter",
    ...          "latest", 2)
    >>> a.names, a.unload, a.held
    (['latest', 'hf-step-000006'], ['hf-step-000002'], 'hf-step-000004')
    """
    names = [stable_name] + ([snapshot] if keep else [])
    own = [n for n in held.own if n != snapshot] + ([snapshot] if keep else [])
    unload = own[: max(0, len(own) - keep)]
    return Adapter(path, snapshot, names, unload, held.stable)


def learn(held: Held, snapshot: str, stable_name: str, loaded: Iterable[str], unloaded: Iterable[str]) -> Held:
    """What the engine holds after a load of ``snapshot`` under ``loaded`` and the unloads of ``unloaded``.

    >>> learn(Held("hf-step-000004", "hf-step-000002", ["hf-step-000004"]), "hf-step-000006", "latest",
    ...       ["latest", "hf-step-000006"], [])
    Held(stable='hf-step-000006', replaced='hf-step-000004', own=['hf-step-000004', 'hf-step-000006'])
    """
    loaded, gone = list(loaded), set(unloaded)
    stable, replaced = held.stable, held.replaced
    if stable_name in loaded and snapshot != stable:
        stable, replaced = snapshot, held.stable
    own = [n for n in held.own if n not in gone and n != snapshot]
    if snapshot in loaded:
        own.append(snapshot)
    return Held(stable, replaced, own)


def initial(adapters: Mapping[str, str], stable_name: str, snapshots: Mapping[str, Tuple[int, str]]) -> Held:
    """What an engine holds at the start, from its list of adapters ({name: directory as it sees it}) and the
    snapshots of the output directory ({name: (step, its adapter's directory as the engine sees it)}): the snapshot
    under the stable name (else that adapter's directory), and those under their own names, oldest first.

    >>> initial({"latest": "/m/hf-4/adapter", "hf-2": "/m/hf-2/adapter", "x": "/y"}, "latest",
    ...         {"hf-2": (2, "/m/hf-2/adapter"), "hf-4": (4, "/m/hf-4/adapter")})
    Held(stable='hf-4', replaced=None, own=['hf-2'])
    """
    by_path = {path: name for name, (_, path) in snapshots.items()}
    root = adapters.get(stable_name)
    stable = by_path.get(root, root) if root else None
    own = sorted((n for n, path in adapters.items() if n in snapshots and snapshots[n][1] == path),
                 key=lambda n: snapshots[n][0])
    return Held(stable, None, own)
