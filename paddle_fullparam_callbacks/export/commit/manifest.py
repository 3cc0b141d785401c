"""The snapshot manifest (``fullparam_manifest.json``): what was exported, from where, how fast."""
from __future__ import annotations

import collections
import time
from importlib import metadata
from pathlib import Path
from typing import Dict, Iterable

from ... import _dtypes
from ..._version import __version__
from ..write import checksum
from ...plan.export_plan import ExportPlan

MANIFEST_VERSION = 1


def _version_of(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    out = {"paddle_fullparam_callbacks": __version__}
    for dist in ("paddlepaddle", "paddlepaddle-gpu", "paddleformers", "paddlenlp", "safetensors"):
        v = _version_of(dist)
        if v:
            out[dist] = v
    return out


def dominant_float_dtype(plan: ExportPlan):
    """The floating dtype holding most bytes (what config.json's dtype should say): quantized weights and
    what is made from them (their scales) are not counted, they are the quantization's."""
    by = collections.Counter()
    for s in plan.slots.values():
        row = _dtypes.lookup(s.dtype)
        if row.is_float and not row.quantized and s.name not in plan.companions:
            by[s.dtype] += s.nbytes
    return by.most_common(1)[0][0] if by else None


def describe_files(directory: Path, names: Iterable[str]) -> Dict[str, tuple]:
    out = {}
    for n in names:
        data = (directory / n).read_bytes()
        out[n] = (len(data), checksum.new(checksum.DEFAULT, data).hexdigest())
    return out


def clean_metrics(metrics) -> dict:
    """JSON-able metrics: numbers as floats, everything else as text."""
    return {str(k): (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v))
            for k, v in (metrics or {}).items()}


def build_manifest(*, name, step, reason, metrics, config, plan: ExportPlan, files: Dict[str, tuple], timings, framework, topology=None,
                   model=None, run=None, traffic=None) -> dict:
    total = sum(b for b, _ in files.values())
    return {
        "manifest_version": MANIFEST_VERSION,
        "snapshot": name,
        "step": int(step),
        "reason": reason,
        "metrics": clean_metrics(metrics),
        "created_unix": time.time(),
        "export_format": config.export.format,
        "dtype": config.export.dtype,
        "async_write": bool(config.export.async_write),
        "framework": framework,
        "run": run or {},
        "model": model or {},
        "num_tensors": plan.num_tensors,
        "tensor_bytes": plan.total_tensor_bytes,
        "total_bytes": total,
        "checksum": checksum.DEFAULT,
        "files": {n: {"bytes": b, checksum.DEFAULT: h} for n, (b, h) in sorted(files.items())},
        "topology": topology or {"world_size": 1, "meshes": [[0]]},
        **({"traffic": traffic} if traffic else {}),
        "timings": {k: round(v, 6) for k, v in timings.items()},
        "versions": versions(),
    }
