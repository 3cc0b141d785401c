"""Casts between floating dtypes on host arrays, bit for bit as Paddle's CPU cast kernel gives them.

A snapshot must hold the bits Paddle gives (the tests compare exports made on every path), so each cast
is Paddle's, or a faster kernel proven equal to it on every class of float32 value
(``tests/unit/test_casts.py``: zeros, denormals, normals, rounding ties, the largest values that round
to infinity, infinities, NaNs of every payload and sign):

* float32 -> bfloat16 (the bundled recipes' snapshot dtype): round to nearest even, as Paddle's
  ``cpu_float_to_bfloat16`` and torch do; every NaN becomes ``0x7FFF`` (Paddle's NaN, sign dropped).
  Through ml_dtypes' cast where it is installed (about 6 GB/s of input per core here, against 1 GB/s
  for Paddle's kernel), else numpy integer arithmetic (about 2.5 GB/s); NaNs are then rewritten.
* bfloat16 -> float32: exact (the 16 bits, shifted), as Paddle's kernel.
* every other pair (float16, float64): Paddle's own kernel, a block at a time.

All of them release the GIL, so the workers of ``pool.py`` cast blocks of one tensor side by side.
Arrays carry their Paddle dtype's storage (bfloat16 as ``uint16``, see ``_dtypes``).
"""
from __future__ import annotations

import threading

import numpy as np

from .. import _dtypes
from .copy import copy_into
from .poison import fresh

try:
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # the numpy kernel below gives the same bits
    _ml_dtypes, _BF16 = None, None

PADDLE_BF16_NAN = 0x7FFF  # what Paddle's CPU kernel writes for every NaN (cpu_float_to_bfloat16)
_SUB = 256 * 2**10  # elements per step of a cast: input and output stay in a core's L2 cache
_local = threading.local()


def to_paddle(arr: np.ndarray, dtype: str):
    """A CPU Paddle tensor over a host array's memory (no copy when it is contiguous and writable:
    DLPack cannot signal read-only memory). bfloat16 (held as uint16) goes through a uint8 view:
    Paddle has no uint16 -> bfloat16 view kernel."""
    import paddle

    arr = np.ascontiguousarray(arr) if arr.flags.writeable else np.array(arr, order="C")
    if dtype == "bfloat16":
        shape = list(arr.shape)
        return paddle.from_dlpack(arr.view(np.uint8).reshape(-1)).view("bfloat16").reshape(shape)
    return paddle.from_dlpack(arr)


def scratch(nbytes: int, slot="cast") -> np.ndarray:
    """A uint8 buffer of ``nbytes`` private to the calling thread, reused (no page faults per block);
    ``slot`` (a name): buffers in use at the same time take different slots."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = bufs[slot] = np.empty(max(nbytes, 1 << 20), np.uint8)
    return fresh(buf[:nbytes])


def memory_order(array: np.ndarray):
    """(axes by decreasing stride, the permutation back): ``array.transpose(order)`` walks memory in
    order and ``.transpose(inverse)`` of that is ``array`` again."""
    order = tuple(sorted(range(array.ndim), key=lambda i: -abs(array.strides[i])))
    inverse = tuple(int(i) for i in np.argsort(order)) if order else ()
    return order, inverse


def cast_into(out: np.ndarray, src: np.ndarray, src_dtype: str, dst_dtype: str) -> None:
    """``out[...] = src`` cast from Paddle dtype ``src_dtype`` to ``dst_dtype`` with Paddle's bits.

    ``out``: C-contiguous, ``src``'s shape, the storage of ``dst_dtype``; ``src``: any strides. A
    transposed ``src`` is cast in its memory order into a per-thread scratch buffer, which is then
    copied into file order (``copy_into``): half the bytes to move for a cast to a 2-byte dtype. (Casting
    inside ``copy_into``'s stage, a few hundred rows at a time, measured slower: more, smaller calls.)
    """
    if src_dtype == dst_dtype:
        copy_into(out, src)
        return
    if src.ndim >= 2 and not src.flags.c_contiguous:
        order, inverse = memory_order(src)
        if order != tuple(range(src.ndim)):
            m = src.transpose(order)
            tmp = scratch(out.nbytes, "memory order").view(out.dtype).reshape(m.shape)
            _cast(tmp, m, src_dtype, dst_dtype)
            copy_into(out, tmp.transpose(inverse))
            return
    _cast(out, src, src_dtype, dst_dtype)


def _cast(out: np.ndarray, src: np.ndarray, src_dtype: str, dst_dtype: str) -> None:
    """``cast_into`` for an ``out`` in the same axis order as ``src``, a few hundred KB at a time."""
    if src.ndim == 0 or src.size == 0:
        _cast_flat(out.reshape(-1), np.ascontiguousarray(src).reshape(-1), src_dtype, dst_dtype)
        return
    if src.ndim == 1:
        for s in range(0, src.shape[0], _SUB):
            _cast_flat(out[s:s + _SUB], src[s:s + _SUB], src_dtype, dst_dtype)
        return
    row = max(1, src[0].size)
    rows = max(1, _SUB // row)
    for r in range(0, src.shape[0], rows):
        _cast_flat(out[r:r + rows], src[r:r + rows], src_dtype, dst_dtype)


def _cast_flat(out: np.ndarray, src: np.ndarray, src_dtype: str, dst_dtype: str) -> None:
    if src_dtype == "float32" and dst_dtype == "bfloat16":
        f32_to_bf16(out, src)
    elif src_dtype == "bfloat16" and dst_dtype == "float32":
        np.left_shift(src, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    else:  # Paddle's own kernel, over a contiguous block
        block = np.array(src, order="C")
        cast = to_paddle(block, src_dtype).astype(dst_dtype).numpy()
        storage = np.dtype(_dtypes.lookup(dst_dtype).np_storage)
        out[...] = cast if cast.dtype == storage else cast.view(storage)


def f32_to_bf16(out: np.ndarray, src: np.ndarray, use_ml_dtypes: bool = True, no_nans: bool = False) -> None:
    """float32 ``src`` rounded to bfloat16 bits in ``out`` (uint16, same shape), as Paddle rounds:
    to nearest, ties to even; infinities and signed zeros kept; every NaN ``0x7FFF``. ``no_nans``: the
    caller knows ``src`` holds none (the FP8 quantizer's block maxima say so): the search for them is skipped.

    >>> out = np.empty(4, np.uint16)
    >>> f32_to_bf16(out, np.array([1.0, 1.00390625, 1.01171875, np.nan], np.float32))
    >>> [hex(v) for v in out]
    ['0x3f80', '0x3f80', '0x3f82', '0x7fff']
    """
    if use_ml_dtypes and _BF16 is not None:
        with np.errstate(invalid="ignore"):  # NaNs raise the invalid flag; they are rewritten below
            np.copyto(out.view(_BF16), src, casting="unsafe")
        if no_nans:
            return
        # ml_dtypes keeps a NaN a NaN (tested on every payload): found in the result by two reductions
        # without a temporary (a positive NaN is above 0x7F80 as int16, a negative one above 0xFF80 as
        # uint16), which costs less than reading the float32 source again
        if out.size and (out.view(np.int16).max() > 0x7F80 or out.max() > 0xFF80):
            nan = scratch(out.size * 2, "nan").view(np.uint16).reshape(out.shape)
            np.bitwise_and(out, 0x7FFF, out=nan)
            np.copyto(out, PADDLE_BF16_NAN, where=nan > 0x7F80)
        return
    u = src.view(np.uint32)
    t = scratch(4 * src.size, "rounding").view(np.uint32).reshape(src.shape)
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)  # the rounding bias: half an ulp, one more when the kept part is odd
    np.add(t, u, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    if no_nans:
        return
    nan = scratch(src.size, "nan").view(np.bool_).reshape(src.shape)  # the sum can carry a NaN into infinity:
    np.isnan(src, out=nan)  # the source says which were NaNs
    if nan.any():
        np.copyto(out, PADDLE_BF16_NAN, where=nan)


__all__ = ["cast_into", "f32_to_bf16", "memory_order", "scratch", "to_paddle"]
