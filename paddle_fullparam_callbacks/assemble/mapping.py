"""Destination tensors and where their elements come from, through Paddle's AOAEngine.

An AOA config maps source keys (the model's ``sharded_state_dict``) to destination keys
(the snapshot). Building the engine is the expensive part (about 0.3 ms per statement), so a
:class:`DestinationMap` is built once per job and reused while the source names and shapes are
unchanged (see :func:`source_signature`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .. import _dtypes
from ..plan.export_plan import TensorSpec


class MappingError(ValueError):
    """The name mapping does not fill the destination tensors exactly."""


def dtype_name(tensor_or_dtype) -> str:
    """'float32' for a Paddle tensor, a Paddle dtype or a string."""
    dt = getattr(tensor_or_dtype, "dtype", tensor_or_dtype)
    return _dtypes.lookup(str(dt)).name


def local_shard_info(sharded_state_dict) -> Dict[str, list]:
    """{key: [ShardedWeightDesc]} of the shards this rank holds."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    info = {}
    for key, sw in sharded_state_dict.items():
        info[key] = [
            ShardedWeightDesc(
                key=key,
                local_shape=tuple(sw.local_shape),
                global_shape=tuple(sw.global_shape),
                global_offset=tuple(sw.global_offset),
                dtype=dtype_name(sw.local_tensor),
            )
        ]
    return info


def source_signature(shard_info: Dict[str, list]) -> tuple:
    """What a DestinationMap depends on: names, global shapes and dtypes of the sources."""
    return tuple(sorted((k, tuple(v[0].global_shape), v[0].dtype) for k, v in shard_info.items()))


def _real_dtype(desc) -> str:
    """The dtype a destination ends up with, after any cast in its postprocess lists."""
    found = set()
    for _key, _src, _dst, pp_list in desc.slices:
        for item in reversed(pp_list or []):
            if item in ("float16", "float32", "bfloat16"):
                found.add(item)
                break
    if len(found) > 1:
        raise MappingError(f"slices of one destination are cast to different dtypes: {sorted(found)}")
    return found.pop() if found else desc.dtype


@dataclass
class DestinationMap:
    """Destination tensors (name, shape, dtype) and, per destination, its source slices."""

    specs: List[TensorSpec]
    entries: Dict[str, list]  # name -> [ShardMappingEntry]
    aoa_config: Optional[dict]
    passthrough: List[str] = field(default_factory=list)  # sources exported under their own name
    transformed: List[str] = field(default_factory=list)  # sources some statement read
    source_shapes: Dict[str, tuple] = field(default_factory=dict)  # source name -> global shape

    def __post_init__(self):
        self.spec_by_name: Dict[str, TensorSpec] = {s.name: s for s in self.specs}

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.specs]

    def source_keys(self) -> set:
        return {e.source_slice.key for es in self.entries.values() for e in es}


def build_destination_map(shard_info: Dict[str, list], aoa_config: Optional[dict]) -> DestinationMap:
    """Run AOAEngine over the (global) shard info; check every destination is filled exactly once.

    Raises MappingError naming the destination tensor when an element is left unfilled or
    written twice, and re-raises AOAEngine errors with the offending statement's context.
    """
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    config = dict(aoa_config or {})
    config.setdefault("enable_traceback", False)  # its traceback printer writes to stdout
    try:
        engine = AOAEngine(aoa_config=config, source_state_shard_info=shard_info, destination_state_shard_info=None)
    except (AssertionError, ValueError, KeyError, SyntaxError, RuntimeError) as e:
        raise MappingError(f"the name mapping (aoa) does not apply to this model: {e}") from e

    _check_no_lost_writes(engine)
    specs, entries = [], {}
    for name, desc in engine.output_vars.items():
        if desc is None:
            continue
        shape = tuple(int(d) for d in desc.shape)
        dtype = _real_dtype(desc)
        target = ShardedWeightDesc(name, shape, shape, (0,) * len(shape), dtype)
        try:
            mapping = engine.find_shard_sources(target)
        except (AssertionError, KeyError, ValueError) as e:
            raise MappingError(f"destination tensor {name!r}: {e}") from e
        _check_coverage(name, shape, mapping)
        specs.append(TensorSpec(name, shape, _dtypes.lookup(dtype).name))
        entries[name] = mapping
    if not specs:
        raise MappingError("the name mapping produced no destination tensors")
    transformed = sorted({n for reads, _ in _statement_flow(engine) for n in reads if n in engine.input_vars})
    sources = {k: tuple(v[0].global_shape) for k, v in shard_info.items()}
    return DestinationMap(specs, entries, aoa_config, passthrough_names(engine), transformed, sources)


def _statement_flow(engine):
    """(read names, written names) of each statement, in the order AOAEngine runs them."""
    for stmt in engine.statements:
        left, right = stmt.left_vars, stmt.right_vars
        if engine.aoa_config_reverse:
            left, right = right, left
        yield [v.name for v in left], [v.name for v in right if v.name != "_"]


def _check_no_lost_writes(engine) -> None:
    """Refuse a mapping that replaces a value nobody has read yet: AOAEngine keeps the last write
    and drops the first silently (two statements producing one destination, or a statement
    writing over a source tensor before any statement used it).

    Names rewritten *after* being read are fine: multi-step statements (fused q/k/v, gate/up
    splits, ``^T``) reuse temporary names layer after layer, and only final values are exported.
    """
    unread = set(engine.input_vars)  # values not yet read by any statement
    lost = []
    for reads, writes in _statement_flow(engine):
        unread.difference_update(reads)
        for name in writes:
            if name in unread:
                lost.append(name)
            unread.add(name)
    if lost:
        lost = sorted(set(lost))
        more = f" and {len(lost) - 3} more" if len(lost) > 3 else ""
        raise MappingError(
            f"the name mapping writes {lost[:3]}{more} more than once (a second statement replaces a value "
            "before anything used it, so the first would be lost; each destination must come from one "
            "statement: use a concat statement, e.g. 'a, b -> c, axis=0', to combine sources)"
        )


def passthrough_names(engine) -> List[str]:
    """Destinations that are source tensors no statement touched (exported under their own name)."""
    return sorted(n for n, d in engine.output_vars.items()
                  if d is not None and n in engine.input_vars and n not in engine.intermediate_vars)


def _check_coverage(name: str, shape: tuple, mapping: list) -> None:
    """Every element of the destination filled by exactly one source slice."""
    total = math.prod(shape)
    covered = sum(math.prod(e.target_slice.local_shape) for e in mapping)
    overlap = _overlaps(mapping)
    if covered == total and not overlap:
        return
    if overlap:
        unfilled = " and leaves elements unfilled" if covered <= total else ""
        raise MappingError(
            f"destination tensor {name!r} {list(shape)} is written more than once by the mapping "
            f"(overlapping source slices{unfilled}); check the aoa statements that produce it"
        )
    raise MappingError(
        f"destination tensor {name!r} {list(shape)} is not filled: the mapping covers "
        f"{covered} of {total} elements; check the aoa statements that produce it"
    )


def boxes_intersect(a_off, a_shape, b_off, b_shape) -> bool:
    """Whether two boxes (offset, shape) share an element."""
    return all(max(x, y) < min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape))


def _overlaps(mapping: list) -> bool:
    boxes = [(e.target_slice.global_offset, e.target_slice.local_shape) for e in mapping]
    if len(boxes) < 2:
        return False
    boxes.sort()
    # a destination has a handful of source slices (one per shard); bound the pairwise scan anyway
    window = len(boxes) if len(boxes) <= 256 else 64
    for i in range(len(boxes)):
        for j in range(i + 1, min(len(boxes), i + window)):
            if boxes_intersect(*boxes[i], *boxes[j]):
                return True
    return False


def padding_destinations(dmap: DestinationMap, padding_rows: Dict[str, int]) -> Dict[str, int]:
    """Destination -> row, for the sources whose ``padding_rows`` must be exported as zeros.

    Only a destination that is the whole source, unpermuted (a rename, maybe a cast), can take the
    row as is; any other use of that source is refused rather than exported with the wrong function.
    """
    out = {}
    for key, row in padding_rows.items():
        users = [n for n, es in dmap.entries.items() if any(e.source_slice.key == key for e in es)]
        for name in users:
            es = dmap.entries[name]
            whole = len(es) == 1 and tuple(es[0].target_slice.local_shape) == tuple(es[0].source_slice.global_shape)
            permuted = any(str(item).startswith("[") for item in (es[0].postprocess_list or []))
            if not whole or permuted:
                raise MappingError(
                    f"the embedding {key!r} has a padding row ({row}) that must be exported as zeros, but the mapping "
                    f"reshapes it into {name!r}; map it with a plain rename"
                )
            out[name] = row
    return out


def apply_export_dtype(specs: List[TensorSpec], export_dtype: str) -> List[TensorSpec]:
    """Specs after the export cast: floating tensors take ``export_dtype`` unless it is 'keep'."""
    if export_dtype == "keep":
        return list(specs)
    return [
        TensorSpec(s.name, s.shape, export_dtype) if _dtypes.lookup(s.dtype).is_float else s for s in specs
    ]
