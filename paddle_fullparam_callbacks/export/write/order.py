"""Which tensors a writer has been handed in file order: the producer's view of what it writes without more."""
from __future__ import annotations


class ReceivedInOrder:
    """Per file, how many of its tensors in file order have all been handed over (``received``: the writer's set
    of names, ``note`` called after each is added). A tensor within that prefix is written without any tensor
    handed over after it; one beyond it waits (kept out of order) for one that has not come yet."""

    def __init__(self, files: dict, received: set):
        self._files, self._received, self._prefix = files, received, {}

    def note(self, slot) -> None:
        prefix = self._prefix.get(slot.file_index)
        if prefix is None:
            order = [s.name for s in sorted(self._files[slot.file_index].slots, key=lambda s: s.begin)]
            prefix = self._prefix[slot.file_index] = [order, {n: i for i, n in enumerate(order)}, 0]
        order = prefix[0]
        while prefix[2] < len(order) and order[prefix[2]] in self._received:
            prefix[2] += 1

    def complete_through(self, name: str) -> bool:
        return any(name in p[1] and p[1][name] < p[2] for p in self._prefix.values())
