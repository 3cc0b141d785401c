"""The assembler of a mesh of one rank: every source is whole and local, no communication.

Yields ``(name, paddle.Tensor)`` in the order asked for (the export plan's file order, so the
writer streams sequentially). A destination that is a plain rename of a source is yielded as
the source tensor itself and a pure transpose as a view: no copy is made here; the writer
copies the bytes straight to disk.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, Sequence, Tuple

from .. import _dtypes
from .mapping import DestinationMap, MappingError, dtype_name


def _permutations_and_cast(pp_list):
    perms, cast = [], None
    for item in pp_list or []:
        if isinstance(item, str) and item.startswith("["):
            perms.append([int(x) for x in item.strip("[]").split(",") if x.strip()])
        else:
            cast = item
    return perms, cast


def _whole(desc) -> bool:
    return tuple(desc.local_shape) == tuple(desc.global_shape) and not any(desc.global_offset)


def apply_postprocess(piece, pp_list):
    """Apply an AOA postprocess list (transposes given as '[1, 0]', then casts) to a tensor."""
    import paddle

    perms, cast = _permutations_and_cast(pp_list)
    for perm in perms:
        piece = paddle.transpose(piece, perm)
    if cast is not None and dtype_name(piece) != cast:
        piece = piece.astype(cast)
    return piece


def slice_of(tensor, offset: Sequence[int], shape: Sequence[int]):
    if all(o == 0 for o in offset) and tuple(tensor.shape) == tuple(shape):
        return tensor
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return tensor[index]


def assemble_destination(name: str, dmap: DestinationMap, source_slice):
    """Build destination ``name`` from its mapping entries.

    ``source_slice(desc)`` returns the source tensor region described by a ShardedWeightDesc
    (global offset and shape within the source tensor).
    """
    import paddle

    entries = dmap.entries[name]
    if len(entries) == 1 and _whole(entries[0].target_slice):
        return apply_postprocess(source_slice(entries[0].source_slice), entries[0].postprocess_list)
    shape = tuple(entries[0].target_slice.global_shape)
    dtype = dmap.spec_by_name[name].dtype
    out = paddle.empty(list(shape), dtype=dtype)
    for e in entries:
        piece = apply_postprocess(source_slice(e.source_slice), e.postprocess_list)
        index = tuple(slice(o, o + n) for o, n in zip(e.target_slice.global_offset, e.target_slice.local_shape))
        out[index] = piece
    return out


def cast_for_export(tensor, export_dtype: str):
    if export_dtype == "keep":
        return tensor
    current = dtype_name(tensor)
    if current == export_dtype or not _dtypes.lookup(current).is_float:
        return tensor
    return tensor.astype(export_dtype)


class LocalAssembler:
    """Assemble destinations from a sharded state dict whose every shard is whole and local.

    ``transforms``: source key -> function of its tensor giving the tensor to export instead (a
    LoRA merge). It runs when a destination first reads that source, and its result is dropped
    once the last destination reading it has been yielded: one transformed tensor at a time per
    source, never a transformed copy of the model."""

    def __init__(self, sharded_state_dict, dmap: DestinationMap, export_dtype: str = "keep", transforms=None):
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
        self._transformed: Dict[str, object] = {}

    def _source(self, key: str):
        fn = self.transforms.get(key)
        if fn is None:
            return self.sources[key]
        if key not in self._transformed:
            self._transformed[key] = fn(self.sources[key])
        return self._transformed[key]

    def _source_slice(self, desc):
        return slice_of(self._source(desc.key), desc.global_offset, desc.local_shape)

    def run(self, names: Iterable[str]) -> Iterator[Tuple[str, object]]:
        import paddle

        names = list(names)
        uses: Dict[str, int] = {}  # transformed source -> destinations still to read it
        keys_of = {n: {e.source_slice.key for e in self.dmap.entries[n]} & set(self.transforms) for n in names}
        for keys in keys_of.values():
            for k in keys:
                uses[k] = uses.get(k, 0) + 1
        with paddle.no_grad():
            for name in names:
                t = assemble_destination(name, self.dmap, self._source_slice)
                for k in keys_of[name]:
                    uses[k] -= 1
                    if not uses[k]:
                        self._transformed.pop(k, None)
                yield name, cast_for_export(t, self.export_dtype)
                t = None
