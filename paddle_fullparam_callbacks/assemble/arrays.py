"""Host-side assembly: destinations built from source regions held as numpy arrays.

Every assembler (a mesh of one, a multi-rank mesh, slices in files) ends here once its source
regions are in host memory, so a job on an accelerator computes its snapshot with the same code,
and the same bits, as the CPU tests. Arrays carry the bytes of their Paddle dtype (bfloat16 as
``uint16`` bits, see ``_dtypes``); the Paddle dtype name travels beside them.

Casts give the bits of Paddle's own CPU cast kernel (``host/casts.py``: Paddle's kernel, or one proven
equal to it), whichever path assembled a snapshot. The cast to the snapshot's dtype is lazy: the writer
computes it block by block on its worker threads (``host/lazy.py``).
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import numpy as np

from .. import _dtypes
from ..host.casts import to_paddle  # noqa: F401  (re-exported: callers import it from here)
from ..host.lazy import CastArray

Region = Tuple[np.ndarray, str]  # (array, Paddle dtype name)


def permutations_and_cast(pp_list) -> Tuple[List[List[int]], "str | None"]:
    """An AOA postprocess list split into its transposes ('[1, 0]') and its cast (a dtype name)."""
    perms, cast = [], None
    for item in pp_list or []:
        if isinstance(item, str) and item.startswith("["):
            perms.append([int(x) for x in item.strip("[]").split(",") if x.strip()])
        else:
            cast = item
    return perms, cast


def is_whole(desc) -> bool:
    return tuple(desc.local_shape) == tuple(desc.global_shape) and not any(desc.global_offset)


def region_of(arr: np.ndarray, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The box ``offset + shape`` of ``arr`` (a view; ``arr`` itself when the box is all of it)."""
    if not any(offset) and tuple(arr.shape) == tuple(shape):
        return arr
    return arr[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _casting(src: str, dst: str) -> bool:
    return src != dst and _dtypes.lookup(src).is_float and _dtypes.lookup(dst).is_float


def lazy_cast(arr, src: str, dst: str):
    """``arr`` (storage of Paddle dtype ``src``, any strides, or a lazy array) cast to ``dst`` with Paddle's
    bits, as a lazy array computed where it is consumed; non-floating and equal dtypes as they are."""
    if not _casting(src, dst):
        return arr
    return CastArray(arr, src, dst, np.dtype(_dtypes.lookup(dst).np_storage))


def cast_array(arr, src: str, dst: str) -> np.ndarray:
    """``arr`` (storage of Paddle dtype ``src``) cast to ``dst`` the way Paddle casts it, as a new array
    (computed in blocks on the worker threads: a read-only or strided ``arr``, a view of a mapped file
    or a transposed weight, costs no copy beside the result). Non-floating and equal dtypes are
    returned as they are."""
    if not _casting(src, dst):
        return arr
    return lazy_cast(arr, src, dst).materialize()


def cast_for_export(arr, dtype: str, export_dtype: str):
    """The array in the snapshot's dtype (``export.dtype``; 'keep' and non-floating tensors unchanged):
    a lazy array when it casts (the writer casts it block by block on its workers)."""
    return arr if export_dtype == "keep" else lazy_cast(arr, dtype, export_dtype)


def postprocess(arr: np.ndarray, dtype: str, pp_list) -> Region:
    """An AOA postprocess list applied on the host: transposes as views, then the cast."""
    perms, cast = permutations_and_cast(pp_list)
    for perm in perms:
        arr = arr.transpose(perm)
    if cast is not None and cast != dtype:
        arr, dtype = cast_array(arr, dtype, cast), cast
    return arr, dtype


def assemble_destination(entries, spec_dtype: str, region: Callable[[object], Region]) -> Region:
    """Destination from its mapping ``entries``; ``region(desc)`` gives the source box a
    ``ShardedWeightDesc`` names (key, global offset, shape) as ``(array, dtype)``.

    A destination that is one whole source comes out as that source's array, transposed as a view:
    no copy is made here; the writer copies the bytes into file order."""
    if len(entries) == 1 and is_whole(entries[0].target_slice):
        return postprocess(*region(entries[0].source_slice), entries[0].postprocess_list)
    out = np.empty(tuple(entries[0].target_slice.global_shape), dtype=_dtypes.lookup(spec_dtype).np_storage)
    for e in entries:
        piece, dtype = postprocess(*region(e.source_slice), e.postprocess_list)
        if dtype != spec_dtype:
            piece = cast_array(piece, dtype, spec_dtype)
        index = tuple(slice(o, o + n) for o, n in zip(e.target_slice.global_offset, e.target_slice.local_shape))
        out[index] = piece
        del piece
    return out, spec_dtype


def storage_view(flat: np.ndarray, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Flat uint8 bytes seen as an array of Paddle dtype ``dtype`` and ``shape`` (no copy)."""
    return flat.view(_dtypes.lookup(dtype).np_storage).reshape(tuple(shape))
