"""The export plan: which tensor goes to which safetensors file, at which offset.

Pure: computed from (name, shape, dtype) alone, identically on every rank, before any byte is
written. The writer carries it out and decides nothing.
"""
from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .. import _dtypes


@dataclass(frozen=True)
class TensorSpec:
    """A destination tensor as it will stand in the snapshot."""

    name: str
    shape: tuple
    dtype: str  # Paddle dtype name, see _dtypes
    # the tensor this one is made from by the same writer (an FP8 weight's scale): always in its file
    companion_of: "str | None" = None

    def __post_init__(self):
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise ValueError(f"tensor {self.name!r} has an invalid shape {self.shape!r}") from None
        object.__setattr__(self, "shape", shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtypes.lookup(self.dtype).itemsize


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes go: ``[begin, end)`` of its file's data section."""

    name: str
    dtype: str
    shape: tuple
    file_index: int
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardFile:
    index: int
    name: str
    header: bytes  # the 8-byte length prefix and the padded JSON header
    slots: tuple

    @property
    def data_bytes(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def total_bytes(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass(frozen=True)
class ExportPlan:
    files: tuple
    max_shard_size: int
    slots: dict = field(repr=False, compare=False)  # name -> TensorSlot
    companions: dict = field(default_factory=dict, repr=False, compare=False)  # companion name -> its tensor

    def assembled(self):
        """The names an assembler must deliver, in file order: every tensor but the companions (the writer
        makes those from their tensor)."""
        return [s.name for f in self.files for s in sorted(f.slots, key=lambda s: s.begin) if s.name not in self.companions]

    @property
    def total_tensor_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def num_tensors(self) -> int:
        return len(self.slots)

    @property
    def needs_index(self) -> bool:
        """A single file carries no ``model.safetensors.index.json`` (transformers' layout)."""
        return len(self.files) > 1

    def index(self) -> dict:
        """The ``model.safetensors.index.json`` object."""
        weight_map = {}
        for f in self.files:
            for s in sorted(f.slots, key=lambda s: natural_key(s.name)):
                weight_map[s.name] = f.name
        return {"metadata": {"total_size": self.total_tensor_bytes}, "weight_map": weight_map}


def natural_key(name: str):
    """Sort key that orders ``layers.2`` before ``layers.10``.

    >>> sorted(["l.10.w", "l.2.w", "emb"], key=natural_key)
    ['emb', 'l.2.w', 'l.10.w']
    """
    parts = tuple((0, int(p), "") if p.isdecimal() else (1, 0, p) for p in re.split(r"(\d+)", name) if p)
    return parts + ((2, 0, name),)  # the raw name breaks ties ("a1" vs "a01"): a total order


def build_header(slots: Sequence[TensorSlot], metadata: "dict | None") -> bytes:
    """The safetensors header of a file holding ``slots``: u64 length + JSON padded to 8 bytes."""
    obj = {}
    if metadata is not None:
        obj["__metadata__"] = dict(metadata)
    for s in slots:
        obj[s.name] = {
            "dtype": _dtypes.lookup(s.dtype).st_code,
            "shape": list(s.shape),
            "data_offsets": [s.begin, s.end],
        }
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * ((-len(text)) % 8)  # the data section starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text


def _validate_specs(specs: Sequence[TensorSpec]) -> None:
    seen = set()
    owners = {t.name for t in specs if t.companion_of is None}
    for t in specs:
        if t.companion_of is not None and t.companion_of not in owners:
            raise ValueError(f"tensor {t.name!r} is a companion of {t.companion_of!r}, which is not in the export")
        if not t.name or t.name == "__metadata__":
            raise ValueError(f"invalid tensor name {t.name!r}")
        if t.name in seen:
            raise ValueError(f"tensor {t.name!r} appears twice in the export; each name must be unique")
        seen.add(t.name)
        if any(d < 0 for d in t.shape):
            raise ValueError(f"tensor {t.name!r} has an invalid shape {t.shape!r}")
        try:
            _dtypes.lookup(t.dtype)
        except ValueError as e:
            raise ValueError(f"tensor {t.name!r}: {e}") from e


def build_export_plan(
    specs: Iterable[TensorSpec],
    max_shard_size: int,
    *,
    prefix: str = "model",
    metadata: "dict | None" = None,
) -> ExportPlan:
    """Pack tensors, in natural name order, into files of at most ``max_shard_size`` data bytes.

    A tensor larger than the limit gets a file of its own. Inside a file, tensors of larger
    item size come first, so that every tensor's data is aligned to its item size.

    >>> p = build_export_plan([TensorSpec("a", (2, 2), "float32"), TensorSpec("b", (3,), "float32")], 16)
    >>> [f.name for f in p.files], [(s.name, s.begin, s.end) for s in p.files[1].slots]
    (['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'], [('b', 0, 12)])
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    specs = list(specs)
    _validate_specs(specs)
    return plan_from_groups(pack(specs, max_shard_size), max_shard_size, prefix=prefix, metadata=metadata)


def pack(specs: Iterable[TensorSpec], max_shard_size: int) -> list:
    """Tensors in natural name order, cut into consecutive groups of at most ``max_shard_size`` data bytes
    (a larger tensor alone). Always at least one group. A companion follows its tensor into its group.

    >>> [[t.name for t in g] for g in pack([TensorSpec(n, (2,), "float32") for n in "abc"], 16)]
    [['a', 'b'], ['c']]
    >>> [[t.name for t in g] for g in pack([TensorSpec("a", (2,), "float32"), TensorSpec("b", (2,), "float32"),
    ...                                     TensorSpec("a_s", (1,), "float32", companion_of="a")], 12)]
    [['a', 'a_s'], ['b']]
    """
    groups: list = []
    current: list = []
    current_bytes = 0
    for unit in units(specs):
        nbytes = sum(t.nbytes for t in unit)
        if current and current_bytes + nbytes > max_shard_size:
            groups.append(current)
            current, current_bytes = [], 0
        current.extend(unit)
        current_bytes += nbytes
    if current or not groups:
        groups.append(current)
    return groups


def units(specs: Iterable[TensorSpec]) -> list:
    """``[[tensor, its companions...], ...]`` in natural name order of the tensors: what files never split."""
    specs = list(specs)
    extra: dict = {}
    for t in specs:
        if t.companion_of is not None:
            extra.setdefault(t.companion_of, []).append(t)
    return [[t, *extra.get(t.name, ())] for t in sorted((t for t in specs if t.companion_of is None),
                                                         key=lambda t: natural_key(t.name))]


def storage_order(group: Sequence[TensorSpec]) -> list:
    """One file's tensors in the order of their bytes.

    By item size, largest first (stable: name order among equals), so that every tensor starts at a multiple of
    its item size, as safetensors' own writer orders them. Companions (an FP8 weight's ``weight_scale_inv``) go
    after all the other tensors when they stay aligned there: a companion is known only once its tensor arrives,
    so a companion stored ahead of its tensor keeps the writer from hashing the file in order until the file's
    last tensor is in (past its stash, it reads the whole file back: issue 47's 7.6 B run). When the bytes before
    them would misalign them (an odd count of 1- or 2-byte elements), they keep their place by item size.

    >>> [t.name for t in storage_order([TensorSpec("w", (4, 4), "uint8"), TensorSpec("w_s", (1,), "float32",
    ...                                  companion_of="w"), TensorSpec("n", (4,), "bfloat16")])]
    ['n', 'w', 'w_s']
    >>> [t.name for t in storage_order([TensorSpec("w", (3, 3), "uint8"), TensorSpec("w_s", (1,), "float32",
    ...                                  companion_of="w")])]
    ['w_s', 'w']
    """
    def by_size(ts):
        return sorted(ts, key=lambda t: -_dtypes.lookup(t.dtype).itemsize)

    main = by_size([t for t in group if t.companion_of is None])
    extra = by_size([t for t in group if t.companion_of is not None])
    offset = sum(t.nbytes for t in main)
    for t in extra:
        if offset % _dtypes.lookup(t.dtype).itemsize:
            return by_size(group)
        offset += t.nbytes
    return main + extra


def plan_from_groups(groups: Sequence[Sequence[TensorSpec]], max_shard_size: int, *, prefix: str = "model",
                     metadata: "dict | None" = None) -> ExportPlan:
    """The files of ``groups`` (one file each, in the order given): names, slots, headers."""
    specs = [t for g in groups for t in g]
    _validate_specs(specs)
    metadata = {"format": "pt"} if metadata is None else metadata
    n = len(groups)
    files = []
    slots_by_name = {}
    for i, group in enumerate(groups):
        group = storage_order(group)
        offset = 0
        slots = []
        for t in group:
            s = TensorSlot(t.name, _dtypes.lookup(t.dtype).name, tuple(t.shape), i, offset, offset + t.nbytes)
            offset = s.end
            slots.append(s)
            slots_by_name[t.name] = s
        # one file: "model.safetensors" and no index, as transformers writes it (PaddleNLP 2.8's
        # torch-format loader converts names only for that layout)
        name = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        files.append(ShardFile(i, name, build_header(slots, metadata), tuple(slots)))
    companions = {t.name: t.companion_of for t in specs if t.companion_of is not None}
    for name, owner in companions.items():
        if slots_by_name[name].file_index != slots_by_name[owner].file_index:
            raise ValueError(f"tensor {name!r} must be in the file of {owner!r}, which it is made from")
    return ExportPlan(tuple(files), max_shard_size, slots_by_name, companions)


def assign_writers(plan: ExportPlan, num_writers: int) -> tuple:
    """Which writer (0..num_writers-1) writes each file: largest files first, to the least loaded.

    Deterministic, so every rank computes the same assignment.

    >>> p = build_export_plan([TensorSpec(f"t{i}", (i + 1,), "float32") for i in range(4)], 8)
    >>> assign_writers(p, 2)
    (0, 1, 1, 0)
    """
    if num_writers < 1:
        raise ValueError(f"num_writers must be >= 1, got {num_writers}")
    load = [0] * num_writers
    owner = [0] * len(plan.files)
    for f in sorted(plan.files, key=lambda f: (-f.total_bytes, f.index)):
        w = min(range(num_writers), key=lambda r: (load[r], r))
        owner[f.index] = w
        load[w] += f.total_bytes
    return tuple(owner)
