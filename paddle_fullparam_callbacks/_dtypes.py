"""The one dtype table of the package: Paddle name, bytes, safetensors code, numpy storage.

Every module that needs to translate a dtype reads it from here. bfloat16 has no numpy
dtype; its bytes are carried as ``uint16`` (the same bit pattern Paddle and torch use), and
float8_e4m3fn's as ``uint8``. float8_e4m3fn is ``quantized``: the writer makes it from a wider
float with its block scales (``host/fp8.py``), never a dtype a tensor is cast to.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # Paddle's name, e.g. "float32"
    itemsize: int
    st_code: str  # safetensors header code, e.g. "F32"
    np_storage: str  # numpy dtype holding the raw bytes
    is_float: bool
    quantized: bool = False  # a storage the writer quantizes into (with scales), not a cast target


_TABLE = (
    DType("float64", 8, "F64", "float64", True),
    DType("float32", 4, "F32", "float32", True),
    DType("float16", 2, "F16", "float16", True),
    DType("bfloat16", 2, "BF16", "uint16", True),
    DType("float8_e4m3fn", 1, "F8_E4M3", "uint8", True, quantized=True),
    DType("int64", 8, "I64", "int64", False),
    DType("int32", 4, "I32", "int32", False),
    DType("int16", 2, "I16", "int16", False),
    DType("int8", 1, "I8", "int8", False),
    DType("uint8", 1, "U8", "uint8", False),
    DType("bool", 1, "BOOL", "bool", False),
)

BY_NAME = {d.name: d for d in _TABLE}
BY_ST_CODE = {d.st_code: d for d in _TABLE}

# the export dtypes a user may ask for ("keep" leaves each tensor as it is)
EXPORT_DTYPES = ("keep", "bfloat16", "float16", "float32")


def lookup(name: str) -> DType:
    """Return the table row of a dtype given as Paddle name, ``paddle.float32`` repr or numpy name.

    >>> lookup("paddle.bfloat16").st_code
    'BF16'
    """
    row = BY_NAME.get(name) if isinstance(name, str) else None
    if row is not None:  # the common case, on hot paths: a plain Paddle name
        return row
    return _lookup_slow(str(name))


@functools.lru_cache(maxsize=256)
def _lookup_slow(key: str) -> DType:
    for prefix in ("paddle.", "VarType.", "DataType."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    original = key
    key = key.lower()
    key = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "float": "float32"}.get(key, key)
    try:
        return BY_NAME[key]
    except KeyError:
        raise ValueError(f"unsupported dtype {original!r}; supported: {sorted(BY_NAME)}") from None


def as_bytes_view(array: np.ndarray) -> memoryview:
    """A flat, C-contiguous byte view of ``array`` (copies only if it is not contiguous)."""
    if array.size == 0:
        return memoryview(b"")
    return memoryview(np.ascontiguousarray(array)).cast("B")
