"""Reading the trainers' pickles without running them.

Three readers, none of which can call anything but what it names:

* :func:`index_tensor_pickle` - a ``paddle.save`` of a dict of arrays (``*.distcp``, ``*.pdparams``):
  ``{key: ArrayRef}`` with the byte offset of each array's raw data in the file, without reading it.
  numpy (pickle protocol < 5) writes an array as ``numpy.core.multiarray._reconstruct(ndarray, (0,), b'b')``
  plus ``BUILD (1, shape, dtype, is_fortran, raw_bytes)``, and ``raw_bytes`` is one contiguous
  ``SHORT_BINBYTES`` / ``BINBYTES`` / ``BINBYTES8`` argument: the pure-Python unpickler below records
  its position and seeks past it (inside a 64 KiB frame the position is the frame's start plus the
  offset in the frame; larger payloads are written outside frames). The only globals it accepts are
  numpy's ``_reconstruct`` (a stub), ``ndarray`` (a placeholder), ``dtype`` and ``OrderedDict``
  (a plain dict).
* :func:`load_flex_metadata` - Paddle's flex-checkpoint ``N.metadata``: the three metadata classes
  become inert stand-ins; the only other globals are basic containers.
* :func:`load_records` - ``training_args.bin`` / ``trainer_state.bin``: every class becomes an inert
  record of its pickled state (its ``__init__`` and ``__setstate__`` are never called); only basic
  containers are real.
"""
from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from struct import unpack
from typing import Dict, Optional, Tuple

import numpy as np


class PickleFormatError(ValueError):
    """A pickle that is not what the reader expects (the caller adds the file name)."""


@dataclass(frozen=True)
class ArrayRef:
    """Where one pickled array's raw bytes are: ``nbytes`` from ``offset`` in the file."""

    dtype: np.dtype
    shape: Tuple[int, ...]
    fortran: bool
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Payload:
    offset: int
    nbytes: int


class _ArrayStub:
    """What ``_reconstruct`` returns: BUILD fills in the array's description."""

    def __init__(self):
        self.ref: Optional[ArrayRef] = None

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise PickleFormatError(f"array with an unexpected state {type(state).__name__}")
        _, shape, dtype, fortran, data = state if len(state) == 5 else (None, *state)
        if not isinstance(dtype, np.dtype):
            raise PickleFormatError("array whose dtype is not a numpy dtype")
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise PickleFormatError(f"array of dtype {dtype} is not a plain tensor")
        if dtype.byteorder == ">":
            raise PickleFormatError(f"big-endian array ({dtype.str})")
        if not isinstance(data, _Payload):
            raise PickleFormatError("array whose data is not raw bytes (pickle protocol 4 writes them raw)")
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PickleFormatError(f"array with an invalid shape {shape!r}")
        if data.nbytes != math.prod(shape) * dtype.itemsize:
            raise PickleFormatError(f"array {list(shape)} of {dtype} holds {data.nbytes} bytes, "
                                    f"needs {math.prod(shape) * dtype.itemsize}")
        self.ref = ArrayRef(dtype, shape, bool(fortran), data.offset, data.nbytes)


def _reconstruct(cls, shape, typecode):
    return _ArrayStub()


class _NdarrayPlaceholder:
    pass


_NUMPY_RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}


class _Indexer(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, f, size: int):
        super().__init__(f)
        self._f = f
        self._size = size
        self._frame_start = 0

    def find_class(self, module, name):
        if (module, name) in _NUMPY_RECONSTRUCT:
            return _reconstruct
        if module == "numpy" and name == "ndarray":
            return _NdarrayPlaceholder
        if module == "numpy" and name == "dtype":
            return np.dtype
        if module == "collections" and name == "OrderedDict":
            return dict
        raise PickleFormatError(f"refusing global {module}.{name} (a tensor file holds only numpy arrays)")

    def persistent_load(self, pid):
        raise PickleFormatError("refusing a persistent id (a tensor file holds only numpy arrays)")

    def load_frame(self):
        frame_size, = unpack("<Q", self.read(8))
        if frame_size > self._size:
            raise PickleFormatError(f"a frame of {frame_size} bytes in a file of {self._size}")
        self._unframer.load_frame(frame_size)
        if len(self._unframer.current_frame.getbuffer()) != frame_size:
            raise PickleFormatError("the file ends inside a pickle frame (truncated?)")
        self._frame_start = self._f.tell() - frame_size

    dispatch[pickle.FRAME[0]] = load_frame

    def _payload(self, n: int):
        fr = self._unframer.current_frame
        if fr is not None and fr.tell() < len(fr.getbuffer()):
            pos = self._frame_start + fr.tell()
            if fr.tell() + n > len(fr.getbuffer()):
                raise PickleFormatError("a byte string runs past the end of its pickle frame")
            fr.seek(n, io.SEEK_CUR)
        else:
            self._unframer.current_frame = None
            pos = self._f.tell()
            if pos + n > self._size:
                raise PickleFormatError(f"an array's {n} bytes at offset {pos} run past the end of the file "
                                        f"({self._size} bytes; truncated?)")
            self._f.seek(n, io.SEEK_CUR)
        self.append(_Payload(pos, n))

    def load_short_binbytes(self):
        self._payload(self.read(1)[0])

    def load_binbytes(self):
        n, = unpack("<I", self.read(4))
        self._payload(n)

    def load_binbytes8(self):
        n, = unpack("<Q", self.read(8))
        self._payload(n)

    dispatch[pickle.SHORT_BINBYTES[0]] = load_short_binbytes
    dispatch[pickle.BINBYTES[0]] = load_binbytes
    dispatch[pickle.BINBYTES8[0]] = load_binbytes8


def _refs(obj, path=""):
    if isinstance(obj, _ArrayStub):
        if obj.ref is None:
            raise PickleFormatError(f"array {path!r} was never filled in")
        return obj.ref
    if isinstance(obj, dict):
        return {k: _refs(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_refs(v, path) for v in obj)
    return obj


def index_tensor_pickle(path: "str | os.PathLike") -> Dict[str, object]:
    """``{key: ArrayRef or plain value}`` of a ``paddle.save`` dict, reading no tensor bytes.

    Raises :class:`PickleFormatError` (truncated file, an array whose data lies past the end, a global
    other than numpy's array reconstruction, anything that is not a dict).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            obj = _Indexer(f, size).load()
        except PickleFormatError:
            raise
        except (pickle.UnpicklingError, EOFError) as e:
            raise PickleFormatError(f"not a complete pickle (truncated?): {e or type(e).__name__}") from e
        except Exception as e:  # struct.error, IndexError, ...: a damaged stream
            raise PickleFormatError(f"not a readable pickle: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise PickleFormatError(f"holds a {type(obj).__name__}, not a dict of tensors")
    return _refs(obj)


# ---- flex-checkpoint metadata --------------------------------------------------------------------

class _Record:
    """An inert stand-in: the pickled state lands in ``__dict__``; nothing of the real class runs."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slot state)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def _key(self):
        return tuple(sorted((k, v) for k, v in self.__dict__.items() if k != "_args"))

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return type(self) is type(other) and self._key() == other._key()

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Metadata(_Record):
    pass


class LocalTensorMetadata(_Record):
    pass


class LocalTensorIndex(_Record):
    pass


_META_MODULE = "paddle.distributed.flex_checkpoint.dcp.metadata"
_META_CLASSES = {"Metadata": Metadata, "LocalTensorMetadata": LocalTensorMetadata, "LocalTensorIndex": LocalTensorIndex}
_BASIC = {"tuple": tuple, "list": list, "dict": dict, "set": set, "frozenset": frozenset, "slice": slice}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == _META_MODULE and name in _META_CLASSES:
            return _META_CLASSES[name]
        if module == "builtins" and name in _BASIC:
            return _BASIC[name]
        raise PickleFormatError(f"refusing global {module}.{name} (flex metadata holds only "
                                f"{', '.join(_META_CLASSES)} and basic containers)")

    def persistent_load(self, pid):
        raise PickleFormatError("refusing a persistent id in flex metadata")


def _load(unpickler_cls, path):
    with open(path, "rb") as f:
        try:
            return unpickler_cls(f).load()
        except PickleFormatError:
            raise
        except (pickle.UnpicklingError, EOFError) as e:
            raise PickleFormatError(f"not a complete pickle (truncated?): {e or type(e).__name__}") from e
        except Exception as e:
            raise PickleFormatError(f"not a readable pickle: {type(e).__name__}: {e}") from e


def load_flex_metadata(path: "str | os.PathLike") -> Metadata:
    """Paddle's ``Metadata`` of a flex checkpoint directory, as inert records (no Paddle needed)."""
    obj = _load(_MetadataUnpickler, path)
    if not isinstance(obj, Metadata):
        raise PickleFormatError(f"holds a {type(obj).__name__}, not {_META_MODULE}.Metadata")
    return obj


# ---- training_args.bin / trainer_state.bin -----------------------------------------------------------

class _RecordUnpickler(pickle.Unpickler):
    _standins: Dict[Tuple[str, str], type] = {}

    def find_class(self, module, name):
        if module == "builtins" and name in _BASIC:
            return _BASIC[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        key = (module, name)
        if key not in self._standins:  # an inert class per name: calling it records its arguments
            self._standins[key] = type(name, (_Record,), {"_pickled_as": f"{module}.{name}"})
        return self._standins[key]

    def persistent_load(self, pid):
        raise PickleFormatError("refusing a persistent id")


def load_records(path: "str | os.PathLike"):
    """A pickled object with every class replaced by an inert record (``record.__dict__`` is its state;
    an enum member is a record whose ``_args`` hold its value)."""
    return _load(_RecordUnpickler, path)


def plain(value):
    """The plain value of a record field: an enum member recorded as ``Cls(value)`` gives ``value``."""
    if isinstance(value, _Record):
        args = value.__dict__.get("_args") or ()
        if len(args) == 1 and len(value.__dict__) == 1:
            return args[0]
    return value
