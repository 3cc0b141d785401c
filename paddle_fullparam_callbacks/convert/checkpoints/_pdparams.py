"""PaddleNLP 2.8 checkpoints without unified checkpoint: ``model_state[.SUFFIX].pdparams``.

One ``paddle.save`` pickle per model-parallel rank, named by ``TrainingArguments.weight_name_suffix``:
``model_state.pdparams`` (single process, data parallel), ``model_state.tp01.pdparams``,
``model_state.pp01.pdparams``, ``model_state.tp01_pp01.pdparams``. Names are the single model's
(``llama.layers.0...``, global layer indices also in pipeline stages), layout Paddle's ``[in, out]``.

A tensor-parallel file holds each rank's local tensor and no offsets. Where each lies in the full
tensor is what PaddleNLP's own merge does with it: the model class's
``_get_tensor_parallel_mappings(config, is_split=False)`` gives per tensor a
``functools.partial(merge_fn, is_column=..., is_naive_2fuse=..., is_naive_3fuse=...)``:

* ``is_column``: the ranks' tensors side by side on the last axis, else on axis 0;
* ``is_naive_2fuse`` / ``3fuse``: each rank's tensor is k parts ``[A_r B_r]``, merged as
  ``[A_0 A_1 .. B_0 B_1 ..]``;
* no action: replicated on every rank (rank 0's copy is used).

Those are read here as slice plans (``_plan``), so no tensor is loaded to merge it. A part of a rank's
tensor cut along an inner axis is not contiguous in the file; it becomes one slice per outer index
(a row each, for a fused column-parallel weight).
"""
from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ... import _dtypes
from ._base import CheckpointError, FileSlice, TensorInfo, _fmt
from ._pickles import ArrayRef, PickleFormatError, index_tensor_pickle
from ._safetensors import u16_dtype

_FILE = re.compile(r"^model_state(?:\.([A-Za-z0-9_]+))?\.pdparams$")
_PART = re.compile(r"^(tp|pp)(\d+)$")
_MERGE_FN = "get_tensor_parallel_merge_func.<locals>.fn"  # paddlenlp.transformers.conversion_utils
_KNOWN_KEYWORDS = {"is_column", "transpose", "is_old_qkv", "is_naive_2fuse", "is_naive_3fuse"}


def pdparams_files(path: Path) -> List[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.startswith("model_state") and p.name.endswith(".pdparams"))


def _grid(path: Path, files: List[Path], tp_expected: int, pp_expected: int) -> Dict[Tuple[int, int], Path]:
    """{(tp rank, pp rank): file}, complete for the degrees the names and the job's arguments give."""
    if any(p.name.startswith("model_state") and p.name.endswith(".index.json") for p in path.iterdir()):
        raise CheckpointError(f"{path}: a model_state*.pdparams.index.json (a weight split over several files per rank, "
                              "past save_pretrained's max_shard_size) is not supported")
    grid = {}
    for f in files:
        m = _FILE.match(f.name)
        if not m:
            raise CheckpointError(f"{f.name}: not a model_state[.tpXX][_ppYY].pdparams name")
        ranks = {"tp": 0, "pp": 0}
        for part in (m.group(1) or "").split("_") if m.group(1) else []:
            pm = _PART.match(part)
            if not pm:
                raise CheckpointError(f"{f.name}: suffix part {part!r} (expert-parallel or sharded model state) is not supported; "
                                      "only tensor- and pipeline-parallel files (tpXX, ppYY) are")
            ranks[pm.group(1)] = int(pm.group(2))
        grid[(ranks["tp"], ranks["pp"])] = f
    tp = max(tp_expected, 1 + max(t for t, _ in grid))
    pp = max(pp_expected, 1 + max(p for _, p in grid))
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in grid]
    if missing:
        def name(t, p):
            parts = ([f"tp{t:02d}"] if tp > 1 else []) + ([f"pp{p:02d}"] if pp > 1 else [])
            return "model_state" + ("." + "_".join(parts) if parts else "") + ".pdparams"
        raise CheckpointError(f"{path}: {', '.join(name(t, p) for t, p in missing)} missing: the job had "
                              f"tensor_parallel_degree {tp} and pipeline_parallel_degree {pp} "
                              f"(found {', '.join(sorted(f.name for f in files))})")
    return grid


def _index(f: Path) -> Dict[str, ArrayRef]:
    try:
        raw = index_tensor_pickle(f)
    except PickleFormatError as e:
        raise CheckpointError(f"{f.name}: {e}") from e
    out = {}
    for k, v in raw.items():
        if isinstance(v, ArrayRef):
            if "@@." in str(k):
                raise CheckpointError(f"{f.name}: tensor {k!r} is one piece of a tensor paddle.save split for pickle "
                                      "protocol 2/3; re-save with protocol 4 (Paddle's default)")
            out[str(k)] = v
    return out


def _dtype(ref: ArrayRef, config: Optional[dict], where: str) -> str:
    if ref.dtype == np.uint16:
        return u16_dtype(config, where)
    try:
        return _dtypes.lookup(ref.dtype.name).name
    except ValueError:
        raise CheckpointError(f"{where}: unsupported dtype {ref.dtype}") from None


def _blocks(f: Path, ref: ArrayRef, axis: int, start: int, length: int, at: Tuple[int, ...]) -> List[FileSlice]:
    """FileSlices for ``local[..., start:start+length (on axis), ...]`` of the array ``ref`` in ``f``, the
    sub-block placed at global offset ``at``. Contiguous in the file when ``axis`` is the outermost in
    memory; else one slice per index of the axes outside it."""
    shape, item = ref.shape, ref.dtype.itemsize
    if start == 0 and length == shape[axis]:  # the whole array (plain concatenation): one block
        return [FileSlice(f, at, shape, ref.dtype.name, ref.offset, ref.fortran)]
    outer = range(axis) if not ref.fortran else range(axis + 1, len(shape))
    block = list(shape)
    block[axis] = length
    for a in outer:
        block[a] = 1
    out = []
    for idx in np.ndindex(*[shape[a] for a in outer]):
        first = [0] * len(shape)
        first[axis] = start
        for a, i in zip(outer, idx):
            first[a] = i
        elem = int(np.ravel_multi_index(first, shape, order="F" if ref.fortran else "C")) if math.prod(shape) else 0
        glob = list(at)
        for a, i in zip(outer, idx):
            glob[a] += i
        out.append(FileSlice(f, tuple(glob), tuple(block), ref.dtype.name, ref.offset + elem * item, ref.fortran))
    return out


def _plan(key: str, action, files: List[Path], refs: List[ArrayRef]) -> Tuple[Tuple[int, ...], List[FileSlice]]:
    """The global shape and the slices of a tensor merged by PaddleNLP ``action`` from ``refs`` (rank order)."""
    func = getattr(action, "func", None)
    keywords = dict(getattr(action, "keywords", None) or {})
    if not isinstance(action, functools.partial) or getattr(func, "__qualname__", "") != _MERGE_FN:
        raise CheckpointError(f"tensor {key!r}: the model class's merge action {action!r} is not PaddleNLP's "
                              "tensor-parallel merge function; its layout cannot be read as slices")
    if set(keywords) - _KNOWN_KEYWORDS or keywords.get("transpose") or keywords.get("is_old_qkv"):
        raise CheckpointError(f"tensor {key!r}: merge action with {keywords} (transpose / old qkv reordering) is not "
                              "a plain concatenation; not supported")
    ndim = len(refs[0].shape)
    if ndim == 0:
        raise CheckpointError(f"tensor {key!r}: a 0-d tensor has a merge action")
    axis = ndim - 1 if keywords.get("is_column", True) else 0
    parts = 2 if keywords.get("is_naive_2fuse") else 3 if keywords.get("is_naive_3fuse") else 1
    others = {tuple(d for a, d in enumerate(r.shape) if a != axis) for r in refs}
    if len(others) != 1 or len({r.dtype for r in refs}) != 1:
        raise CheckpointError(f"tensor {key!r}: the ranks' tensors {[_fmt(r.shape) for r in refs]} "
                              f"({sorted({str(r.dtype) for r in refs})}) cannot be joined along axis {axis}")
    if any(r.shape[axis] % parts for r in refs):
        raise CheckpointError(f"tensor {key!r}: a rank's {[_fmt(r.shape) for r in refs]} does not split into "
                              f"{parts} fused parts along axis {axis}")
    slices, cursor = [], 0
    for j in range(parts):  # [A_0 A_1 .. B_0 B_1 ..]: naive_fuse_merge_tp's order
        for f, r in zip(files, refs):
            width = r.shape[axis] // parts
            at = [0] * ndim
            at[axis] = cursor
            slices += _blocks(f, r, axis, j * width, width, tuple(at))
            cursor += width
    shape = list(refs[0].shape)
    shape[axis] = cursor
    return tuple(shape), slices


def _whole(f: Path, ref: ArrayRef) -> FileSlice:
    return FileSlice(f, (0,) * len(ref.shape), ref.shape, ref.dtype.name, ref.offset, ref.fortran)


def _merge_actions(model_class, config: Optional[dict], tp: int, keys: List[str], where: str) -> Dict[str, object]:
    """{file key: merge action} from the model class (PaddleNLP's own rules, resolved against the file's keys)."""
    if model_class is None:
        raise CheckpointError(f"{where}: tensor-parallel files ({tp} ranks) need the model class for PaddleNLP's merge "
                              "rules (the class config.json's architectures names; a *Pipe class's plain class)")
    if config is None:
        raise CheckpointError(f"{where}: tensor-parallel files need config.json for the model class's merge rules")
    for attr in ("_get_tensor_parallel_mappings", "_resolve_prefix_keys", "config_class"):
        if not hasattr(model_class, attr):
            raise CheckpointError(f"{where}: model class {getattr(model_class, '__name__', model_class)!r} has no {attr} "
                                  "(a PaddleNLP PretrainedModel is expected)")
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    fields.update(tensor_parallel_degree=tp, tensor_parallel_rank=0)
    try:
        cfg = model_class.config_class.from_dict(fields)
        if isinstance(cfg, tuple):
            cfg = cfg[0]
        actions = model_class._get_tensor_parallel_mappings(cfg, is_split=False)
        names = model_class._resolve_prefix_keys(list(actions), keys, ignore_error=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: {model_class.__name__}'s merge rules failed on config.json: "
                              f"{type(e).__name__}: {e}") from e
    return {names[k]: a for k, a in actions.items() if k in names}


def open_pdparams(path: Path, config: Optional[dict], model_class, parallel: Dict[str, int]) -> Dict[str, TensorInfo]:
    files = pdparams_files(path)
    grid = _grid(path, files, parallel.get("tensor_parallel_degree", 1), parallel.get("pipeline_parallel_degree", 1))
    tp = 1 + max(t for t, _ in grid)
    pp = 1 + max(p for _, p in grid)
    for name, files_say in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)):
        if parallel.get(name, files_say) != files_say:
            raise CheckpointError(f"{path}: the file names give {name} {files_say}, training_args.bin / config.json "
                                  f"say {parallel[name]} (files: {', '.join(f.name for f in files)})")
    tensors: Dict[str, TensorInfo] = {}
    for stage in range(pp):
        stage_files = [grid[(t, stage)] for t in range(tp)]
        indexes = [_index(f) for f in stage_files]
        keys = list(indexes[0])
        for f, ix in zip(stage_files[1:], indexes[1:]):
            if set(ix) != set(keys):
                odd = sorted(set(ix) ^ set(keys))[0]
                raise CheckpointError(f"{f.name} and {stage_files[0].name} hold different tensors (e.g. {odd!r}): "
                                      "tensor-parallel ranks of one stage hold the same names")
        actions = _merge_actions(model_class, config, tp, keys, stage_files[0].name) if tp > 1 else {}
        for key in keys:
            refs = [ix[key] for ix in indexes]
            where = f"{stage_files[0].name}: tensor {key!r}"
            if key in actions:
                shape, slices = _plan(key, actions[key], stage_files, refs)
            else:
                if len({(r.shape, r.dtype) for r in refs}) != 1:
                    raise CheckpointError(f"{where} differs across the tensor-parallel ranks "
                                          f"({[_fmt(r.shape) for r in refs]}) but the model class has no merge rule for it")
                shape, slices = refs[0].shape, [_whole(stage_files[0], refs[0])]
            info = TensorInfo(tuple(shape), _dtype(refs[0], config, where), slices)
            if key in tensors:  # a tensor of several pipeline stages (a shared embedding): the first stage's
                if (tensors[key].global_shape, tensors[key].dtype) != (info.global_shape, info.dtype):
                    raise CheckpointError(f"{where}: pipeline stages hold it with different shapes or dtypes")
                continue
            tensors[key] = info
    return tensors
