"""The assembler of a mesh of one rank: every source is whole and local, no communication.

Yields ``(name, host array)`` in the order asked for (the export plan's file order, so the writer
streams sequentially). Sources reach host memory through the device boundary (``device.py``): a
CPU parameter is shared, not copied, so a destination that is a plain rename of a source is the
parameter's own memory and a pure transpose a view of it; the writer copies the bytes straight to
disk. A parameter on an accelerator is copied out once, held while a destination still needs it,
and dropped after its last use.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterable, Iterator, Optional, Tuple

import numpy as np

from .. import _dtypes
from ..host.lazy import LazyArray
from .arrays import Region, assemble_destination, cast_for_export, is_whole, permutations_and_cast, region_of
from .device import DeviceBoundary, dtype_of
from .mapping import DestinationMap, MappingError


def castable_early(dmap: DestinationMap, names: Iterable[str], export_dtype: str, transforms) -> set:
    """Source keys whose export cast may run before assembly (on the device, where the budget allows):
    every destination reading them is the whole source, maybe transposed, with no cast of its own, in
    the source's dtype, and no transform (LoRA merge) changes the source first."""
    if export_dtype == "keep":
        return set()
    ok: Dict[str, bool] = {}
    for name in names:
        entries = dmap.entries[name]
        simple = (len(entries) == 1 and is_whole(entries[0].target_slice)
                  and permutations_and_cast(entries[0].postprocess_list)[1] is None)
        spec_dtype = dmap.spec_by_name[name].dtype
        for e in entries:
            key = e.source_slice.key
            fine = (simple and key not in transforms and _dtypes.lookup(spec_dtype).is_float
                    and (e.source_slice.dtype or spec_dtype) == spec_dtype)
            ok[key] = ok.get(key, True) and fine
    return {k for k, fine in ok.items() if fine}


def transposed_early(dmap: DestinationMap, names: Iterable[str], transforms) -> set:
    """Source keys that every destination reads whole and transposed ([1, 0], a Linear weight in Hugging
    Face's layout), with no transform: the device boundary may transpose them on the device, so that
    their bytes reach the host in file order (where the budget allows)."""
    ok: Dict[str, bool] = {}
    for name in names:
        entries = dmap.entries[name]
        for e in entries:
            perms, _ = permutations_and_cast(e.postprocess_list)
            fine = (len(entries) == 1 and is_whole(e.target_slice) and perms == [[1, 0]]
                    and e.source_slice.key not in transforms)
            ok[e.source_slice.key] = ok.get(e.source_slice.key, True) and fine
    return {k for k, fine in ok.items() if fine}


class LocalAssembler:
    """Assemble destinations from a sharded state dict whose every shard is whole and local.

    ``transforms``: source key -> ``fn(host array, dtype)`` giving the array to export instead (a LoRA
    merge). It runs when a destination first reads that source, and its result is dropped once the
    last destination reading it has been yielded: one transformed tensor at a time per source, never
    a transformed copy of the model. ``boundary``: moves device slices to the host within the device
    memory budget (default: a budget of 0)."""

    def __init__(self, sharded_state_dict, dmap: DestinationMap, export_dtype: str = "keep", transforms=None,
                 boundary: Optional[DeviceBoundary] = None):
        self.sources: Dict[str, object] = {}
        for key, sw in sharded_state_dict.items():
            if tuple(sw.local_shape) != tuple(sw.global_shape):
                raise MappingError(
                    f"source {key!r} is a shard {list(sw.local_shape)} of {list(sw.global_shape)}: "
                    "a single-rank export needs whole tensors (use the multi-rank assembler)"
                )
            self.sources[key] = sw.local_tensor
        self.dmap = dmap
        self.export_dtype = export_dtype
        self.transforms = dict(transforms or {})
        self.boundary = boundary or DeviceBoundary()
        self._held: Dict[str, Region] = {}
        self._early: set = set()
        self._transposed: set = set()

    def _source(self, key: str) -> Region:
        held = self._held.get(key)
        if held is None:
            cast = self.export_dtype if key in self._early else None
            arr, dtype = self.boundary.host_array(self.sources[key], cast_to=cast, transposed=key in self._transposed)
            fn = self.transforms.get(key)
            if fn is not None:
                arr = fn(arr, dtype)
            held = self._held[key] = (arr, dtype)
        return held

    def _region(self, desc) -> Region:
        arr, dtype = self._source(desc.key)
        if isinstance(arr, LazyArray) and (any(desc.global_offset) or tuple(desc.local_shape) != tuple(arr.shape)):
            arr = arr.materialize()  # a part of a lazy (merged) source: computed once, held while still needed
            self._held[desc.key] = (arr, dtype)
        return region_of(arr, desc.global_offset, desc.local_shape), dtype

    def run(self, names: Iterable[str]) -> Iterator[Tuple[str, np.ndarray]]:
        names = list(names)
        keys_of = {n: {e.source_slice.key for e in self.dmap.entries[n]} for n in names}
        uses = Counter(k for keys in keys_of.values() for k in keys)  # destinations still to read each source
        self._early = castable_early(self.dmap, names, self.export_dtype, self.transforms)
        self._transposed = transposed_early(self.dmap, names, self.transforms)
        for name in names:
            arr, dtype = assemble_destination(self.dmap.entries[name], self.dmap.spec_by_name[name].dtype, self._region)
            for k in keys_of[name]:
                uses[k] -= 1
                if not uses[k]:
                    self._held.pop(k, None)
            yield name, cast_for_export(arr, dtype, self.export_dtype)
            arr = None


__all__ = ["LocalAssembler", "castable_early", "dtype_of", "transposed_early"]
