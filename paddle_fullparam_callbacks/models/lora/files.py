"""LoRA checkpoints on disk (``convert``): each LoRA weight merged when a region of it is read.

A checkpoint of a LoRA run holds, beside (PaddleFormers' flex checkpoints) or without (PaddleNLP's
``lora_model_state.pdparams``, whose base comes from ``--base``) the base weights, ``<layer>.lora_A``
``[in, r]`` and ``<layer>.lora_B`` ``[r, out]``. What the files do not hold is the scaling: it comes
from the run's ``lora_config.json`` (``lora_alpha``, ``rslora``, ``pissa``), which PaddleNLP saves into
its checkpoints and PaddleFormers does not (``--lora-config``).

:class:`MergedTensors` is the export's tensor source: the base records only, and ``read`` of a
region of a LoRA weight returns ``W[region] + s * A[rows] @ B[:, cols]`` (``merge.py``), the same bits
the callback writes for that step. No merged tensor is kept: a region is merged when it is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .layers import LoraError
from .merge import MergedArray

_SUFFIXES = (".lora_A", ".lora_B")


@dataclass
class StoredLora:
    """A LoRA layer of a checkpoint: its tensors' keys and settings (what ``adapter.py`` needs of a layer)."""

    name: str
    weight_key: str
    a_key: str
    b_key: str
    r: int
    alpha: float
    scaling: float
    pissa: bool = False

    def state(self) -> str:
        return "active"  # a checkpoint holds the base weights and the adapter apart


def is_lora_key(key: str) -> bool:
    return key.endswith(_SUFFIXES)


def stored_layers(lora_shapes: Dict[str, tuple], base_shapes: Dict[str, tuple], settings: dict) -> List[StoredLora]:
    """The LoRA layers of a checkpoint from its tensors' names and shapes, checked against the base
    weights; ``settings``: the run's ``lora_config.json`` (``lora_alpha``, ``rslora``, ``pissa``)."""
    prefixes = sorted({k[: -len(".lora_A")] for k in lora_shapes if k.endswith(_SUFFIXES)})
    if "lora_alpha" not in settings:
        raise LoraError("the LoRA config has no lora_alpha: the merge's scaling cannot be known")
    alpha, rslora, pissa = settings["lora_alpha"], bool(settings.get("rslora")), bool(settings.get("pissa"))
    out = []
    for p in prefixes:
        a, b, w = p + ".lora_A", p + ".lora_B", p + ".weight"
        missing = [k for k in (a, b) if k not in lora_shapes] + ([w] if w not in base_shapes else [])
        if missing:
            raise LoraError(f"LoRA layer {p!r}: {missing} missing from the checkpoint (and the base model)")
        (n_in, r), (r2, n_out), wshape = lora_shapes[a], lora_shapes[b], tuple(base_shapes[w])
        if r != r2 or wshape != (n_in, n_out):
            raise LoraError(f"LoRA layer {p!r}: lora_A {list(lora_shapes[a])}, lora_B {list(lora_shapes[b])} do not fit "
                            f"its weight {list(wshape)} (expected W [in, out], A [in, r], B [r, out])")
        if settings.get("r") not in (None, r):
            raise LoraError(f"LoRA layer {p!r} has rank {r}, the LoRA config says r={settings['r']}")
        scaling = 1.0 if pissa else (alpha / math.sqrt(r) if rslora else alpha / r)  # the layers' own arithmetic
        out.append(StoredLora(p, w, a, b, int(r), alpha, scaling, pissa))
    return out


class MergedTensors:
    """A tensor source (``export.source.TensorSource``) over ``base`` whose LoRA weights read merged."""

    def __init__(self, base, lora, layers: Sequence[StoredLora]):
        self.base, self.lora = base, lora
        self.layers = {lay.weight_key: lay for lay in layers}
        self._dtypes = {r.key: r.dtype for r in base.records()}
        self._lora_dtypes = {r.key: r.dtype for r in lora.records()}

    def records(self) -> List:
        return self.base.records()

    def read(self, key: str, offset: Sequence[int], shape: Sequence[int]):
        lay = self.layers.get(key)
        w = self.base.read(key, offset, shape)
        if lay is None:
            return w
        (r0, c0), (m, n) = offset, shape
        a = self.lora.read(lay.a_key, (r0, 0), (m, lay.r))
        b = self.lora.read(lay.b_key, (0, c0), (lay.r, n))
        dtype = self._dtypes[key]
        try:  # merged in float32, cast once (Paddle's bits); the rest block by block where it is written
            return MergedArray(w, dtype, a, self._lora_dtypes[lay.a_key], b, self._lora_dtypes[lay.b_key], lay.scaling)
        except ValueError as e:
            raise LoraError(f"LoRA layer {lay.name!r}: {e}") from e

    def describe(self) -> dict:
        return self.base.describe()


def lora_settings(obj: Optional[dict], where: str) -> dict:
    """The fields of a ``lora_config.json`` the merge needs, checked."""
    if not isinstance(obj, dict):
        raise LoraError(f"{where}: not a JSON object")
    alpha = obj.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraError(f"{where}: lora_alpha is {alpha!r}, not a positive number")
    return {k: obj[k] for k in ("r", "lora_alpha", "rslora", "pissa", "target_modules", "base_model_name_or_path")
            if obj.get(k) is not None}


__all__ = ["MergedTensors", "StoredLora", "is_lora_key", "lora_settings", "stored_layers"]
