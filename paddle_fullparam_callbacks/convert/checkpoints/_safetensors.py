"""Safetensors checkpoints: one whole tensor per header entry.

* PaddleFormers ``unified_checkpoint`` / ``sharding_io`` (single process): HF names and HF layout
  (``model-*-of-*.safetensors`` + ``model.safetensors.index.json``, or ``model.safetensors``).
* PaddleNLP 2.8 ``unified_checkpoint=True``: PaddleNLP names, Paddle layout, tensors merged over the
  tensor-parallel ranks, bfloat16 written as ``U16`` (only config.json's ``dtype`` says it is bfloat16).

The header check is ``export.write.header.read_header``'s (length bound, strict JSON, every entry's
size, the tensors tiling the data area, nothing past the end), with one code more: ``U16``, which the
package's dtype table does not carry because no export writes it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ... import _dtypes
from ...export.write.header import SafetensorsFormatError, parse_json_strict, read_header, short
from ._base import CheckpointError, FileSlice, TensorInfo

_U16 = "U16"  # PaddleNLP's bfloat16 (its numpy writer has no bfloat16)


@dataclass(frozen=True)
class StEntry:
    name: str
    code: str  # safetensors dtype code
    shape: Tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def storage(self) -> str:
        return "uint16" if self.code == _U16 else _dtypes.BY_ST_CODE[self.code].np_storage


def read_st_header(path: Path) -> Tuple[Optional[dict], Dict[str, StEntry]]:
    """The checked header of a safetensors file (``export.write.header.read_header``'s checks, with
    ``U16`` accepted): ``(metadata, {name: StEntry})``."""
    try:
        metadata, entries, start = read_header(path, extra_codes={_U16: 2})
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e)) from e
    return metadata, {k: StEntry(k, e.dtype, e.shape, start + e.begin, e.end - e.begin) for k, e in entries.items()}


def config_dtype(config: Optional[dict]) -> Optional[str]:
    """The model dtype config.json states (``dtype``, else ``torch_dtype``), as a ``_dtypes`` name."""
    for k in ("dtype", "torch_dtype"):
        v = (config or {}).get(k)
        if isinstance(v, str):
            try:
                return _dtypes.lookup(v).name
            except ValueError:
                return None
    return None


def u16_dtype(config: Optional[dict], where: str) -> str:
    """``U16`` / uint16 data is bfloat16 exactly when config.json says the model is bfloat16."""
    said = config_dtype(config)
    if said == "bfloat16":
        return "bfloat16"
    raise CheckpointError(
        f"{where} is stored as uint16 (how PaddleNLP writes bfloat16), but config.json says the model dtype is "
        f"{said or 'nothing'}: cannot tell bfloat16 from uint16 (give a config with \"dtype\": \"bfloat16\")")


_SHARD = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
_RANK_FILE = re.compile(r"^model\.(tp|pp)\d+.*\.safetensors$")


def model_safetensors(path: Path) -> List[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors"))


def open_safetensors(path: Path, config: Optional[dict]) -> Dict[str, TensorInfo]:
    """Index the model safetensors of checkpoint ``path`` (index.json's weight map, or ``model.safetensors``)."""
    files = model_safetensors(path)
    rank_files = [p.name for p in files if _RANK_FILE.match(p.name)]
    if rank_files:
        raise CheckpointError(
            f"{path}: {', '.join(rank_files)} hold each tensor-parallel rank's local tensors, and neither the files nor "
            "PaddleFormers record where each lies in the full tensor (its Llama has no merge rule): save with "
            "save_checkpoint_format=\"flex_checkpoint\" (the default) or convert each rank's model on its own")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            obj = parse_json_strict(index.read_bytes())
        except ValueError as e:
            raise CheckpointError(f"{index.name}: {e}") from e
        wmap = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index.name}: no weight_map of tensor name -> file name")
        shards = sorted(set(wmap.values()))
        for s in shards:
            if not _SHARD.match(s):
                raise CheckpointError(f"{index.name}: weight_map names {short(s)}, not a model-*-of-*.safetensors file here")
            if not (path / s).is_file():
                raise CheckpointError(f"{index.name}: {s} is missing (the weight map lists "
                                      f"{sum(v == s for v in wmap.values())} tensors in it)")
    else:
        plain = [p for p in files if _SHARD.match(p.name)]
        if [p.name for p in plain] != ["model.safetensors"]:
            raise CheckpointError(f"{path}: model.safetensors.index.json is missing; without it only a lone "
                                  f"model.safetensors can be read (found {', '.join(p.name for p in plain) or 'none'})")
        _, entries = read_st_header(plain[0])
        wmap = {k: plain[0].name for k in entries}
        shards = [plain[0].name]
    headers = {s: read_st_header(path / s)[1] for s in shards}
    tensors = {}
    for key, fname in wmap.items():
        e = headers[fname].get(key)
        if e is None:
            raise CheckpointError(f"{fname}: has no tensor {short(key)} (model.safetensors.index.json puts it there)")
        dtype = u16_dtype(config, f"{fname}: tensor {key!r}") if e.code == _U16 else _dtypes.BY_ST_CODE[e.code].name
        tensors[key] = TensorInfo(e.shape, dtype, [FileSlice(path / fname, (0,) * len(e.shape), e.shape, e.storage, e.offset)])
    return tensors
