"""PaddleFormers 1.2 flex checkpoints (``save_checkpoint_format="flex_checkpoint"``, the default).

``checkpoint-N/model_state/`` holds one ``{uid}.metadata`` (a pickle of Paddle's ``Metadata``: per
tensor its global shape, dtype and the slices, per slice the file that holds it) and one
``{rank}_{uid}.distcp`` per rank (a ``paddle.save`` pickle of that rank's slices as numpy arrays;
bfloat16 as uint16). Replicated slices are written once (``replica_id`` None), or, with
``save_replicas``, once per copy (0 is the main one). The metadata is written first and never
rewritten, so a crashed save leaves metadata that names missing or short data files: every file,
key, shape and dtype is checked against it here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Tuple

from ... import _dtypes
from ._base import CheckpointError, FileSlice, TensorInfo, _fmt
from ._pickles import ArrayRef, LocalTensorIndex, LocalTensorMetadata, PickleFormatError, index_tensor_pickle, load_flex_metadata
from ._safetensors import read_st_header

MODEL_STATE = "model_state"  # PaddleFormers utils/env.py MODEL_STATE_DIC
_METADATA = re.compile(r"^\d+\.metadata$")
_DATA_FILE = re.compile(r"^[A-Za-z0-9_.-]+\.(distcp|safetensors)$")


def metadata_files(directory: Path):
    return sorted(p for p in directory.iterdir() if p.is_file() and _METADATA.match(p.name)) if directory.is_dir() else []


def _ints(value, what: str) -> Tuple[int, ...]:
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CheckpointError(f"{what} is {value!r}, not a tuple of sizes")
    return value


def _dtype_name(value, where: str) -> str:
    try:
        return _dtypes.lookup(str(value)).name
    except ValueError:
        raise CheckpointError(f"{where}: unsupported dtype {value!r} (supported: {sorted(_dtypes.BY_NAME)})") from None


def _refuse_flattened(where: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is a flattened slice (sharding stage 1 v2 / stage 3 with tensor fusion): a C-order range of a "
        "block, not a block; model weights are not flattened in stage 1 and this reader does not rebuild them")


class _Files:
    """Each data file indexed once: {tensor key: (storage dtype, shape, fortran, byte offset)}."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._index: Dict[str, dict] = {}

    def get(self, fname: str, meta_name: str) -> dict:
        if fname not in self._index:
            if not isinstance(fname, str) or not _DATA_FILE.match(fname):
                raise CheckpointError(f"{meta_name}: names a data file {fname!r} that is not a plain file name")
            path = self.directory / fname
            if not path.is_file():
                raise CheckpointError(f"{MODEL_STATE}/{fname} is missing: {meta_name} says it holds slices "
                                      "(a rank's save did not finish, or the file was not copied)")
            if fname.endswith(".safetensors"):
                _, entries = read_st_header(path)
                self._index[fname] = {k: (e.storage, e.shape, False, e.offset) for k, e in entries.items()}
            else:
                try:
                    raw = index_tensor_pickle(path)
                except PickleFormatError as e:
                    raise CheckpointError(f"{MODEL_STATE}/{fname}: {e}") from e
                self._index[fname] = {k: (v.dtype.name, v.shape, v.fortran, v.offset)
                                      for k, v in raw.items() if isinstance(v, ArrayRef)}
        return self._index[fname]


def open_flex(path: Path) -> Dict[str, TensorInfo]:
    """Index ``path/model_state``: every model tensor's global shape, dtype and slices (no tensor bytes read)."""
    directory = path / MODEL_STATE
    metas = metadata_files(directory)
    if len(metas) != 1:
        raise CheckpointError(f"{MODEL_STATE}/ holds {len(metas)} metadata files ({', '.join(p.name for p in metas)}); "
                              "a flex checkpoint has exactly one (Paddle's loader refuses others too)")
    meta_name = f"{MODEL_STATE}/{metas[0].name}"
    try:
        meta = load_flex_metadata(metas[0])
    except PickleFormatError as e:
        raise CheckpointError(f"{meta_name}: {e}") from e
    declared = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_metadata", None)
    if not isinstance(declared, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{meta_name}: no state_dict_metadata / storage_metadata tables")

    tensors: Dict[str, TensorInfo] = {}
    blocks: Dict[str, Dict[Tuple[int, ...], Tuple[int, ...]]] = {}  # key -> {global offset: local shape}
    for key, entries in declared.items():
        where = f"{meta_name}: tensor {key!r}"
        if not isinstance(key, str) or not isinstance(entries, list) or not entries \
                or not all(isinstance(m, LocalTensorMetadata) for m in entries):
            raise CheckpointError(f"{where} has no list of LocalTensorMetadata")
        shapes = {_ints(getattr(m, "global_shape", None), f"{where}: global_shape") for m in entries}
        dtypes = {_dtype_name(getattr(m, "dtype", None), where) for m in entries}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise CheckpointError(f"{where}: its slices disagree on the global shape or dtype "
                                  f"({sorted(shapes)}, {sorted(dtypes)})")
        for m in entries:
            if getattr(m, "is_flattened", False):
                raise _refuse_flattened(where)
        blocks[key] = {_ints(m.global_offset, f"{where}: global_offset"): _ints(m.local_shape, f"{where}: local_shape")
                       for m in entries}
        tensors[key] = TensorInfo(shapes.pop(), dtypes.pop(), [])

    files = _Files(directory)
    for index, fname in storage.items():
        if not isinstance(index, LocalTensorIndex):
            raise CheckpointError(f"{meta_name}: storage_metadata has a {type(index).__name__} key")
        key = getattr(index, "tensor_key", None)
        where = f"{meta_name}: tensor {key!r}"
        if getattr(index, "replica_id", None) not in (None, 0):
            continue  # save_replicas=True: the other copies of replica 0
        if key not in tensors:
            raise CheckpointError(f"{where} is in storage_metadata ({fname}) but not in state_dict_metadata")
        if getattr(index, "is_flattened", False):
            raise _refuse_flattened(where)
        offset = _ints(index.global_offset, f"{where}: global_offset")
        local = blocks[key].get(offset)
        if local is None or (getattr(index, "local_shape", None) is not None
                             and _ints(index.local_shape, f"{where}: local_shape") != local):
            raise CheckpointError(f"{where}: storage entry at {_fmt(offset)} in {fname} is not one of the tensor's "
                                  f"declared slices {sorted(blocks[key].items())}")
        info = tensors[key]
        held = files.get(fname, meta_name).get(key)
        want = _dtypes.lookup(info.dtype).np_storage
        if held is None:
            raise CheckpointError(f"{MODEL_STATE}/{fname} does not hold tensor {key!r}, which {meta_name} puts there")
        if held[0] != want or tuple(held[1]) != local:
            raise CheckpointError(
                f"{MODEL_STATE}/{fname}: tensor {key!r} is {held[0]} {_fmt(held[1])}, but {meta_name} says "
                f"{info.dtype} (stored as {want}) {_fmt(local)} at {_fmt(offset)}")
        info.slices.append(FileSlice(directory / fname, offset, local, want, int(held[3]), bool(held[2])))
    return tensors

