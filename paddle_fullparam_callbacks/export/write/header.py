"""Bounds-checked reading of safetensors files: the header, one tensor, strict JSON.

Never pickle, never trust a length or an offset of the file: every entry is checked against the
file's size and its neighbours before any byte of data is read.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ... import _dtypes

_MAX_HEADER = 100 * 2**20  # same bound as the safetensors library


class SafetensorsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str  # safetensors code
    shape: tuple
    begin: int
    end: int


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"duplicate key {short(k)}")
        out[k] = v
    return out


def _no_constant(token):
    raise ValueError(f"{token} is not JSON")


def parse_json_strict(data: bytes):
    """Parse UTF-8 JSON bytes, refusing what ``json.loads`` would let through or crash on.

    Raises ValueError with a reason to print after the file name: not UTF-8, not valid JSON
    (NaN and Infinity included), a duplicate key (the two readers of a file could disagree on
    its value), nested too deeply (``RecursionError`` otherwise).

    >>> parse_json_strict(b'{"a": [1, 2]}')
    {'a': [1, 2]}
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise ValueError(f"has a {e}") from e
    except RecursionError as e:
        raise ValueError("is not valid JSON (nested too deeply)") from e
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e})") from e


def short(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: names and values in messages come from the files."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(fname: str, name: str, e, extra_codes=None) -> HeaderEntry:
    """One checked header entry; raises SafetensorsFormatError naming the file and the tensor.
    ``extra_codes``: dtype codes beyond the package's table, with their item sizes."""
    where = f"{fname}: tensor {short(name)}"
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
        raise SafetensorsFormatError(f"{where} has a malformed header entry {short(e)}")
    code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    itemsize = None
    if isinstance(code, str):
        row = _dtypes.BY_ST_CODE.get(code)
        itemsize = row.itemsize if row is not None else (extra_codes or {}).get(code)
    if itemsize is None:
        raise SafetensorsFormatError(f"{where} has unknown dtype {short(code)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise SafetensorsFormatError(f"{where} has invalid shape {short(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise SafetensorsFormatError(f"{where} has invalid offsets {short(offsets)}")
    begin, end = offsets
    expected = math.prod(shape) * itemsize
    if end - begin != expected:
        raise SafetensorsFormatError(
            f"{where} spans {end - begin} bytes, its shape {list(shape)} of {code} needs {expected}")
    return HeaderEntry(name, code, tuple(shape), begin, end)


def _check_layout(fname: str, entries: dict, data_start: int, size: int) -> None:
    """The tensors tile the data area exactly: no overlap, no gap, nothing past the end or after it."""
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < cursor:
            raise SafetensorsFormatError(f"{fname}: tensor {short(e.name)} overlaps the tensor before it")
        if e.begin > cursor:
            raise SafetensorsFormatError(f"{fname}: a gap of {e.begin - cursor} bytes lies before tensor {short(e.name)}")
        cursor = e.end
    if data_start + cursor > size:
        last = max(entries.values(), key=lambda e: e.end).name if entries else "?"
        raise SafetensorsFormatError(
            f"{fname}: tensor {short(last)} runs past the end of the file ({data_start + cursor} > {size} bytes; truncated?)"
        )
    if data_start + cursor < size:
        raise SafetensorsFormatError(f"{fname}: {size - data_start - cursor} trailing bytes after the last tensor")


def parse_header(f, fname: str, extra_codes=None) -> tuple:
    """:func:`read_header` of an open binary file (read from its start); ``fname`` names it in messages."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    raw = f.read(8)
    if len(raw) < 8:
        raise SafetensorsFormatError(f"{fname}: file is {size} bytes, too short for a header")
    n = int.from_bytes(raw, "little")
    if n > _MAX_HEADER:
        raise SafetensorsFormatError(f"{fname}: header length {n} is over the limit of {_MAX_HEADER} bytes")
    if 8 + n > size:
        raise SafetensorsFormatError(f"{fname}: header length {n} runs past the file ({size} bytes)")
    text = f.read(n)
    if len(text) < n:
        raise SafetensorsFormatError(f"{fname}: the file shrank while it was read")
    try:
        obj = parse_json_strict(text)
    except ValueError as e:
        raise SafetensorsFormatError(f"{fname}: header {e}") from e
    if not isinstance(obj, dict):
        raise SafetensorsFormatError(f"{fname}: header is not a JSON object")
    metadata = obj.pop("__metadata__", None)
    entries = {name: _entry(fname, name, e, extra_codes) for name, e in obj.items()}
    _check_layout(fname, entries, 8 + n, size)
    return metadata, entries, 8 + n


def _open_regular(path: Path):
    """Open ``path`` for reading; refuse a directory, FIFO or device (O_NONBLOCK: a FIFO cannot block)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SafetensorsFormatError(f"{path.name}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: "str | os.PathLike", extra_codes=None) -> tuple:
    """Parse and bounds-check a safetensors header. Returns (metadata, {name: HeaderEntry}, data_start).

    ``extra_codes``: {dtype code: item size} accepted beyond the package's dtypes (e.g. PaddleNLP's
    ``U16``). Raises SafetensorsFormatError naming the file and the tensor at fault (OSError if it
    cannot be opened).
    """
    path = Path(path)
    with _open_regular(path) as f:
        return parse_header(f, path.name, extra_codes)


def read_tensor(path: "str | os.PathLike", name: str) -> np.ndarray:
    """Read one tensor as a numpy array (bfloat16 as uint16 bits)."""
    path = Path(path)
    with _open_regular(path) as f:
        _, entries, start = parse_header(f, path.name)
        e = entries[name]
        f.seek(start + e.begin)
        data = f.read(e.end - e.begin)
    if len(data) != e.end - e.begin:
        raise SafetensorsFormatError(f"{path.name}: the file shrank while tensor {short(name)} was read")
    storage = np.dtype(_dtypes.BY_ST_CODE[e.dtype].np_storage)
    return np.frombuffer(data, dtype=storage).reshape(e.shape)
