"""What an export takes in and gives back: the model's side (``ModelSource``), the result
(``SnapshotInfo``) and the one error every failure becomes (``ExportError``).

A ``ModelSource`` normally gives the tensors of a live model (``sharded_state_dict``). ``convert``
gives them from files instead (``tensors``): the same plan, writer and commit, another source.

Two optional parts serve models whose exported weights are computed from several tensors (LoRA):
``local_transforms`` turn a rank's slice of a source into the slice to export (merged just
before it is used, dropped after), and ``companions`` are further tensors committed inside the
snapshot, in a subdirectory of their own (a PEFT adapter). A source without them exports as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple


class ExportError(RuntimeError):
    """An export failed; nothing of it was committed."""


class TensorSource(Protocol):
    """Slices on disk instead of in a model (``paddle-fullparam convert``).

    ``records()`` lists the regions it can give (``assemble.mesh.ShardRecord``: rank, key, global
    offset, shape, global shape, Paddle dtype name; ``convert``'s: one record per tensor, its whole
    global shape, rank 0); ``read(key, offset, shape)`` returns any region within them as a numpy
    array or a lazy one (``host.lazy.LazyArray``: ``convert``'s read nothing until the writer fills
    its own buffers with them), bfloat16 as uint16 bits. ``describe()`` says what it is, for the
    manifest.
    """

    def records(self) -> List[Any]:
        ...

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]):
        ...

    def describe(self) -> Dict[str, Any]:
        ...


@dataclass
class Companion:
    """Tensors committed with the snapshot in ``<snapshot>/<directory>/`` (e.g. a PEFT adapter), from
    sources the snapshot's own mapping never sees.

    ``destinations(dmap, shard_info)``: given the snapshot's ``DestinationMap`` and the companion's
    sources (``{key: [ShardedWeightDesc]}``, every mesh rank's slices), the companion's own
    ``DestinationMap``. Its tensors go to one file ``<file_prefix>.safetensors`` (no index), assembled
    by the coordinator's mesh and written by the coordinator, with ``json_files`` beside it.
    """

    directory: str
    file_prefix: str
    destinations: Callable[[Any, Dict[str, list]], Any]
    sharded_state_dict: Optional[Callable[[], dict]] = None  # this rank's slices (a live model)
    tensors: Optional["TensorSource"] = None  # or slices in files (convert)
    json_files: Dict[str, Any] = field(default_factory=dict)  # file name -> JSON object, or a callable giving it
    metadata: Optional[Dict[str, str]] = None  # the safetensors __metadata__ (None: {"format": "pt"})


@dataclass
class ModelSource:
    """What the export needs from the model, gathered by ``models`` from a live model (the trainer path) or from files (``convert``)."""

    sharded_state_dict: Callable[[], dict]
    aoa_config: Optional[dict] = None
    # when the mapping depends on the whole model (a pipeline stage sees only its layers): called
    # with every mesh rank's source names and global shapes, it returns the aoa config to use
    mapping_for: Optional[Callable[[Dict[str, tuple]], Optional[dict]]] = None
    hf_config: Optional[dict] = None
    generation_config: Optional[dict] = None
    tokenizer: Any = None
    framework: str = "paddle"
    check_mapping: Optional[Callable] = None  # called with the DestinationMap of a new mapping; raises to refuse
    padding_rows: Dict[str, int] = field(default_factory=dict)  # source key -> embedding row exported as zeros
    notes: Dict[str, Any] = field(default_factory=dict)  # recorded in the manifest under "model"
    # slices read from files (convert): when set, sharded_state_dict is not called and the
    # records and tensors come from here; a live model may still give names, config and mapping
    tensors: Optional[TensorSource] = None
    # source key -> fn(this rank's slice of it as a host array, its dtype name) -> the slice to export,
    # a host array of the same shape and dtype; applied by the assemblers when the slice is first
    # read (after the device boundary: on the host), dropped once used
    local_transforms: Dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    companions: List[Companion] = field(default_factory=list)
    # export.quantization (FP8): fn([(destination name, shape)]) -> (the names stored as FP8, the modules
    # config.json lists in modules_to_not_convert): the architecture's declaration (models/mappings)
    quantization: Optional[Callable[[List[Tuple[str, tuple]]], Tuple[List[str], List[str]]]] = None


@dataclass
class SnapshotInfo:
    name: str
    step: int
    path: Optional[Path]
    files: int
    bytes: int
    num_tensors: int
    seconds: float
    timings: Dict[str, float] = field(default_factory=dict)
    reason: str = ""
    peak_pending_bytes: int = 0
    files_written_here: int = 0
    pending: bool = False  # async_write: assembled, not yet committed
    stall_s: float = 0.0  # how long training waited for this export

