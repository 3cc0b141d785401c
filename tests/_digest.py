"""Where the elements of a destination tensor come from: what two mappings must agree on to write the
same bytes from the same model (names of intermediate steps and statement order left out). Used by
the zoo's mapping digest (``zoo/run_zoo.py``) and the presets' golden (``unit/preset_golden.py``)."""
from __future__ import annotations


def destination_slices(dmap, name: str) -> tuple:
    """(shape, dtype, sorted slices: target box, source key and box, postprocessing) of ``name``."""
    spec = dmap.spec_by_name[name]
    slices = sorted(
        (tuple(e.target_slice.global_offset), tuple(e.target_slice.local_shape), e.source_slice.key,
         tuple(e.source_slice.global_offset), tuple(e.source_slice.local_shape), tuple(e.postprocess_list or ()))
        for e in dmap.entries[name])
    return tuple(spec.shape), spec.dtype, slices
