"""FP8 snapshots in the plan: which destination tensors become which, and what config.json says of them.

The layout (DeepSeek-V3's, read by transformers, vLLM and llama.cpp): each quantized ``<module>.weight``
``[out, in]`` is stored as float8_e4m3fn, beside ``<module>.weight_scale_inv`` in float32 of shape
``[ceil(out / b0), ceil(in / b1)]`` (edge blocks partial); config.json's ``quantization_config`` names the
method and the block, and ``modules_to_not_convert`` lists the Linear modules left in ``export.dtype``.
The scale is a *companion* of its weight in the export plan: made from the same tensor by the same
writer, always in the same file (``export_plan.TensorSpec.companion_of``).

Pure: from names, shapes and dtypes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Sequence, Tuple

from .. import _dtypes
from .export_plan import TensorSpec

FP8 = "float8_e4m3fn"
SCALE_DTYPE = "float32"
METHODS = ("none", "fp8")
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
MISREAD = ("transformers 5.x dequantizes such a weight wrongly: its Fp8Dequantize takes the block as rows // scale "
           "rows (a 200 x 300 weight in 128 x 128 blocks comes back with 100 x 100 blocks, and a 320-row one, 3 "
           "blocks, fails to load); the snapshot holds the layout's partial edge blocks, which llama.cpp's converter "
           "and this package's verify read right")


def scale_name(weight: str) -> str:
    """The scale tensor of a quantized weight: ``<module>.weight`` -> ``<module>.weight_scale_inv``.

    >>> scale_name("model.layers.0.mlp.down_proj.weight")
    'model.layers.0.mlp.down_proj.weight_scale_inv'
    """
    return weight + SCALE_SUFFIX


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> Tuple[int, int]:
    """``[ceil(out / b0), ceil(in / b1)]``.

    >>> scale_shape((200, 300), (128, 128))
    (2, 3)
    """
    return tuple(-(-int(n) // int(b)) for n, b in zip(shape, block))


def misread(shape: Sequence[int], block: Sequence[int]) -> bool:
    """Whether transformers 5.x dequantizes a weight of ``shape`` wrongly: a dimension spanning more than one
    block that is not a multiple of it (:data:`MISREAD`). One partial block (a dimension below the block) it
    reads right.

    >>> misread((200, 256), (128, 128)), misread((64, 96), (128, 128)), misread((256, 256), (128, 128))
    (True, False, False)
    """
    return any(n > b and n % b for n, b in zip(shape, block))


def check_block(value) -> Tuple[int, int]:
    """``export.quantization_block`` as two positive integers; ValueError with the reason otherwise."""
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)
    if not ok:
        raise ValueError(f"must be two positive whole numbers [rows, columns] (default [128, 128]); got {value!r}")
    return int(value[0]), int(value[1])


@dataclass(frozen=True)
class QuantizedWeight:
    """One weight of the snapshot stored as FP8: its scale tensor and the dtype it is quantized from."""

    name: str
    scale: str
    shape: Tuple[int, int]
    dtype: str  # the destination's dtype before quantization (export.dtype): widened to float32 first
    block: Tuple[int, int]


@dataclass(frozen=True)
class Fp8Plan:
    """The weights quantized (by name), the block, and the Linear modules left unquantized."""

    block: Tuple[int, int]
    weights: Dict[str, QuantizedWeight] = field(default_factory=dict)
    not_convert: Tuple[str, ...] = ()

    def config(self) -> dict:
        """config.json's ``quantization_config``."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": list(self.not_convert)}

    def specs(self, specs: Iterable[TensorSpec]) -> List[TensorSpec]:
        """The snapshot's tensors: each quantized weight as float8_e4m3fn, followed by its scale (a companion)."""
        out = []
        for s in specs:
            q = self.weights.get(s.name)
            if q is None:
                out.append(s)
                continue
            out.append(TensorSpec(s.name, s.shape, FP8))
            out.append(TensorSpec(q.scale, scale_shape(s.shape, self.block), SCALE_DTYPE, companion_of=s.name))
        return out

    @property
    def misread(self) -> List[str]:
        """Weights transformers 5.x would dequantize wrongly (:func:`misread`), in name order."""
        return sorted(n for n, q in self.weights.items() if misread(q.shape, self.block))

    def describe(self) -> dict:
        """For the manifest."""
        return {"method": "fp8", "weight_block_size": list(self.block), "weights": len(self.weights),
                "modules_to_not_convert": len(self.not_convert), "misread_by_transformers": self.misread}


def plan_fp8(specs: Sequence[TensorSpec], selected: Iterable[str], not_convert: Iterable[str],
             block: Sequence[int]) -> Fp8Plan:
    """The FP8 plan of ``selected`` destination weights among ``specs`` (in the snapshot's dtype).

    Each must be a 2-D floating tensor with no zero dimension, and its scale name must be free.

    >>> p = plan_fp8([TensorSpec("l.weight", (300, 64), "bfloat16")], ["l.weight"], ["lm_head"], (128, 128))
    >>> [(s.name, s.shape, s.dtype) for s in p.specs([TensorSpec("l.weight", (300, 64), "bfloat16")])]
    [('l.weight', (300, 64), 'float8_e4m3fn'), ('l.weight_scale_inv', (3, 1), 'float32')]
    """
    block = check_block(tuple(block))
    by_name = {s.name: s for s in specs}
    weights = {}
    for name in sorted(set(selected)):
        s = by_name.get(name)
        if s is None:
            raise ValueError(f"{name!r} is declared for FP8 but the snapshot has no such tensor")
        row = _dtypes.lookup(s.dtype)
        if len(s.shape) != 2 or not row.is_float or row.quantized or not math.prod(s.shape):
            raise ValueError(f"{name!r} is declared for FP8 but is {s.dtype}{list(s.shape)}: only 2-D floating "
                             "weights [out, in] can be quantized")
        if scale_name(name) in by_name:
            raise ValueError(f"{name!r} cannot be quantized: the snapshot already has a tensor {scale_name(name)!r}")
        weights[name] = QuantizedWeight(name, scale_name(name), tuple(s.shape), row.name, block)
    return Fp8Plan(block, weights, tuple(sorted(set(not_convert))))


__all__ = ["DEFAULT_BLOCK", "FP8", "Fp8Plan", "METHODS", "MISREAD", "QuantizedWeight", "SCALE_SUFFIX", "check_block",
           "misread", "plan_fp8", "scale_name", "scale_shape"]
