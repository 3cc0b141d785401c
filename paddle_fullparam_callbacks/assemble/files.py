"""The assembler of slices stored in files (``paddle-fullparam convert``): no model, no ranks.

Each destination is built from the regions its mapping entries name, asked of the source one at
a time (``TensorSource.read``: ``convert``'s regions are lazy arrays, nothing read until the
writer's workers fill their own buffers with the bytes they need). A destination that is one whole
region comes out as that region, transposed and cast to ``export.dtype`` lazily (a mapping's own
cast computes a new array); one made of several regions is assembled into a new host array. Yields
``(name, array)`` (bfloat16 as uint16 bits) in the order asked for; nothing but the destination in
hand is held.

Casts go through Paddle's own kernels, so a snapshot converted from a checkpoint has the same
bits as the callback's export of the same weights.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Tuple

import numpy as np

from .arrays import assemble_destination, cast_array, cast_for_export
from .mapping import DestinationMap

__all__ = ["FileAssembler", "cast_array"]


class FileAssembler:
    """Destinations of ``dmap`` from ``tensors`` (see ``export.source.TensorSource``).

    A destination that is one stored region comes out as the source's array for it (transposed as a
    view, or lazily: ``convert``'s regions are read where the writer fills its buffers). ``room(name)``:
    called before each destination is asked of the source, to wait until the writer can take it, so
    that the tensor in hand and the tensors waiting to be written are never both large."""

    def __init__(self, tensors, dmap: DestinationMap, export_dtype: str = "keep",
                 room: Optional[Callable[[str], None]] = None):
        self.tensors = tensors
        self.dmap = dmap
        self.export_dtype = export_dtype
        self.room = room

    def _region(self, src) -> Tuple[np.ndarray, str]:
        return self.tensors.read(src.key, tuple(src.global_offset), tuple(src.local_shape)), src.dtype

    def assemble(self, name: str) -> Tuple[np.ndarray, str]:
        return assemble_destination(self.dmap.entries[name], self.dmap.spec_by_name[name].dtype, self._region)

    def run(self, names: Iterable[str]) -> Iterator[Tuple[str, np.ndarray]]:
        for name in names:
            if self.room is not None:
                self.room(name)
            arr, dtype = self.assemble(name)
            yield name, cast_for_export(arr, dtype, self.export_dtype)
            del arr  # the consumer has it: not held here while the next destination is read
