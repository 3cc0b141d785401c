"""The assembler of slices stored in files (``paddle-fullparam convert``): no model, no ranks.

Each destination is built from the regions its mapping entries name, read one at a time from
the source (memory-mapped: only the bytes asked for are touched), transposed as views and cast
only when a dtype changes. Yields host arrays (bfloat16 as uint16 bits) in the order asked for;
nothing but the destination in hand is held.

Casts go through Paddle's own kernels, so a snapshot converted from a checkpoint has the same
bits as the callback's export of the same weights.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional, Tuple

import numpy as np

from .. import _dtypes
from .local import _permutations_and_cast, _whole
from .mapping import DestinationMap


_CAST_BLOCK_BYTES = 16 * 2**20


def cast_array(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``arr`` (storage of Paddle dtype ``src``) cast to ``dst`` the way Paddle casts it.

    Cast in blocks of rows (about 16 MB each): a read-only or strided ``arr`` (a view of a mapped
    file, a transposed weight) costs one block's copy on top of the result, never a second tensor."""
    if src == dst or not (_dtypes.lookup(src).is_float and _dtypes.lookup(dst).is_float):
        return arr
    from .mesh import _to_paddle

    storage = np.dtype(_dtypes.lookup(dst).np_storage)
    out = np.empty(arr.shape, dtype=storage)
    if arr.size == 0:
        return out
    if arr.ndim == 0:
        flat = [()]
    else:
        rows = max(1, _CAST_BLOCK_BYTES // max(1, arr[0].nbytes if arr.shape[0] else 1))
        flat = [(slice(i, i + rows),) for i in range(0, arr.shape[0], rows)]
    for index in flat:
        block = np.array(arr[index], order="C")  # a writable contiguous copy: what DLPack accepts
        cast = _to_paddle(block, src).astype(dst).numpy()
        out[index] = cast if cast.dtype == storage else cast.view(storage)
    return out


def _postprocess(arr: np.ndarray, dtype: str, pp_list) -> Tuple[np.ndarray, str]:
    perms, cast = _permutations_and_cast(pp_list)
    for perm in perms:
        arr = arr.transpose(perm)
    if cast is not None and cast != dtype:
        arr, dtype = cast_array(arr, dtype, cast), cast
    return arr, dtype


class FileAssembler:
    """Destinations of ``dmap`` from ``tensors`` (see ``export.source.TensorSource``).

    A destination that is one stored region comes out as a read-only view of the files (transposed
    as a view); the writer copies what it needs. ``room(name)``: called before each destination is
    read, to wait until the writer can take it, so that the tensor in hand and the tensors waiting
    to be written are never both large."""

    def __init__(self, tensors, dmap: DestinationMap, export_dtype: str = "keep",
                 room: Optional[Callable[[str], None]] = None):
        self.tensors = tensors
        self.dmap = dmap
        self.export_dtype = export_dtype
        self.room = room

    def _piece(self, entry) -> Tuple[np.ndarray, str]:
        src = entry.source_slice
        arr = self.tensors.read(src.key, tuple(src.global_offset), tuple(src.local_shape))
        return _postprocess(arr, src.dtype, entry.postprocess_list)

    def assemble(self, name: str) -> Tuple[np.ndarray, str]:
        entries = self.dmap.entries[name]
        if len(entries) == 1 and _whole(entries[0].target_slice):
            return self._piece(entries[0])
        spec = self.dmap.spec_by_name[name]
        out = np.empty(tuple(entries[0].target_slice.global_shape), dtype=_dtypes.lookup(spec.dtype).np_storage)
        for e in entries:
            piece, dtype = self._piece(e)
            if dtype != spec.dtype:
                piece = cast_array(piece, dtype, spec.dtype)
            index = tuple(slice(o, o + n) for o, n in zip(e.target_slice.global_offset, e.target_slice.local_shape))
            out[index] = piece
            del piece
        return out, spec.dtype

    def run(self, names: Iterable[str]) -> Iterator[Tuple[str, np.ndarray]]:
        for name in names:
            if self.room is not None:
                self.room(name)
            arr, dtype = self.assemble(name)
            if self.export_dtype != "keep":
                arr = cast_array(arr, dtype, self.export_dtype)
            yield name, arr
            del arr  # the consumer has it: not held here while the next destination is read
