"""The arithmetic of a LoRA merge, on host arrays: ``W + s * A @ B`` for one block of ``W``.

Paddle stores a LoRA layer as ``W [in, out]``, ``lora_A [in, r]``, ``lora_B [r, out]`` and computes
``x @ W + (x @ A @ B) * s``. The merged weight is computed here the way HF peft's
``merge_and_unload()`` computes it from the exported adapter (``lora_A.weight = A^T``,
``lora_B.weight = B^T``): ``delta = (B^T @ A^T) * float32(s)``, then ``W^T + delta``, all in float32.
numpy's matmul accumulates the r products of each element in the order torch's CPU matmul does
(a fused multiply-add chain), so the snapshot's merged weights are bit-identical to peft's merge
of its adapter; Paddle's own merge (``W + paddle.matmul(A, B) * s``) sums the products in another
order and differs from both by at most a few float32 ulps (docs/models.md, "LoRA").

A block is merged alone: r is never split over ranks, so the block of ``W`` a tensor-parallel rank
holds merges with the rows of ``A`` and the columns of ``B`` it holds, and each element of the result
is the same sum as in the whole tensor.

bfloat16 and float16 weights are merged in float32 and cast back once (with Paddle's bits); adapters
kept in those dtypes are widened to float32 first (exactly), as peft does on CPU.

At export, a merge is a :class:`MergedArray`: the product at once, the rest block by block on the worker
threads where it is written (``host/lazy.py``).
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from ... import _dtypes
from ...host import blas
from ...host.casts import cast_into, scratch
from ...host.lazy import LazyArray


def as_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """``arr`` (storage of Paddle dtype ``dtype``; bfloat16 as uint16 bits) as float32, exactly.

    >>> as_float32(np.array([0x3F80, 0xC000], dtype=np.uint16), "bfloat16").tolist()
    [1.0, -2.0]
    """
    name = _dtypes.lookup(dtype).name
    if name == "float32":
        return arr
    if name == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if name == "float16":
        return arr.astype(np.float32)
    raise ValueError(f"a LoRA tensor of dtype {dtype} cannot be merged (float32, bfloat16 or float16 only)")


def delta_hf(a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
    """``(B^T @ A^T) * float32(scaling)``: the update in torch's ``[out, in]`` layout, float32, as peft
    computes it (``lora_B.weight @ lora_A.weight``, then the scalar).

    >>> a = np.array([[1.0], [2.0]], np.float32); b = np.array([[3.0, 4.0, 5.0]], np.float32)
    >>> delta_hf(a, b, 0.5).tolist()
    [[1.5, 3.0], [2.0, 4.0], [2.5, 5.0]]
    """
    out = np.matmul(b.T, a.T)  # [out, r] @ [r, in]
    out *= np.float32(scaling)
    return out


def merged_block(w: np.ndarray, w_dtype: str, a: np.ndarray, a_dtype: str, b: np.ndarray, b_dtype: str,
                 scaling: float) -> np.ndarray:
    """The merged block ``W + s * A @ B`` in Paddle's ``[in, out]`` layout, float32, C-contiguous.

    ``w`` ``[m, n]`` is a block of the weight, ``a`` ``[m, r]`` the matching rows of ``lora_A``, ``b``
    ``[r, n]`` the matching columns of ``lora_B`` (each as storage of its Paddle dtype).

    Computed in Paddle's layout (one new array, updated in place; the writer transposes it as it
    transposes any weight): element ``(i, j)`` of ``A @ B`` is the chain of the same r products, in
    the same order, as element ``(j, i)`` of peft's ``B^T @ A^T`` (checked bit for bit against
    :func:`delta_hf` in the unit tests and against peft itself in the LoRA tests).

    >>> w = np.zeros((2, 3), np.float32); a = np.ones((2, 1), np.float32); b = np.ones((1, 3), np.float32)
    >>> merged_block(w, "float32", a, "float32", b, "float32", 2.0).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    r = a.shape[1]
    if a.shape[0] != w.shape[0] or b.shape != (r, w.shape[1]):
        raise ValueError(f"LoRA block shapes do not fit: W {list(w.shape)}, A {list(a.shape)}, B {list(b.shape)}")
    out = np.matmul(as_float32(a, a_dtype), as_float32(b, b_dtype))
    out *= np.float32(scaling)  # the scalar after the product, as float32: peft's (B^T @ A^T) * scaling
    out += as_float32(w, w_dtype)  # W + delta: one rounding, commutative
    return out


class _Buffers:
    """Reused float32 buffers for the products (a new one costs a page fault per 4 KB, more than the product
    itself); at most ``keep_bytes`` of them are kept between uses."""

    def __init__(self, keep_bytes: int = 64 * 2**20):
        self.keep_bytes, self.free, self.lock = keep_bytes, [], threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
            if fits:
                buf = self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
                return buf[:nbytes]
        return np.empty(max(nbytes, 1), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if buf.base is not None else buf
        with self.lock:
            self.free.append(base)
            self.free.sort(key=lambda b: -b.nbytes)
            while sum(b.nbytes for b in self.free) > self.keep_bytes:
                self.free.pop(0)  # the largest goes first: few, and the least likely to fit another


_BUFFERS = _Buffers()


class _Product:
    """``A @ B`` of one merge, made once, by the first block computed (on a worker), in a reused buffer,
    with numpy's BLAS on that thread only; the buffer goes back once the last block of the merge is gone."""

    def __init__(self, a, a_dtype: str, b, b_dtype: str):
        self.ab = (a, a_dtype, b, b_dtype)
        self.value = None
        self.lock = threading.Lock()

    def get(self) -> np.ndarray:
        if self.value is None:
            with self.lock:
                if self.value is None:
                    a, a_dtype, b, b_dtype = self.ab
                    buf = _BUFFERS.take(a.shape[0] * b.shape[1] * 4)
                    out = buf.view(np.float32).reshape(a.shape[0], b.shape[1])
                    with blas.one_thread():
                        np.matmul(as_float32(a, a_dtype), as_float32(b, b_dtype), out=out)
                    weakref.finalize(self, _BUFFERS.give, buf)
                    self.value = out
        return self.value


class MergedArray(LazyArray):
    """``W + s * A @ B`` in ``w_dtype`` with :func:`merged_block`'s bits, computed where it is consumed: the
    product at once, by the first block asked for, the rest (the scalar, the sum, the cast, the transpose)
    a block at a time: in Paddle's ``[in, out]`` layout, or ``transposed`` (Hugging Face's ``[out, in]``).

    The product ``A @ B`` is one matrix product of the whole weight's shape: OpenBLAS's float32 kernels
    give an element bits that depend on where it falls in the kernel's tiles, so a product made in
    blocks differs from the whole one (measured: r >= 32 here) and from peft's. The element-wise steps
    have no such dependence."""

    def __init__(self, w, w_dtype: str, a, a_dtype: str, b, b_dtype: str, scaling: float,
                 transposed: bool = False, product=None, rows=None, cols=None):
        r = a.shape[1]
        if a.shape[0] != w.shape[0] or b.shape != (r, w.shape[1]):
            raise ValueError(f"LoRA block shapes do not fit: W {list(w.shape)}, A {list(a.shape)}, B {list(b.shape)}")
        self.w, self.w_dtype, self.scaling, self.transposed = w, w_dtype, scaling, transposed
        self.product = product if product is not None else _Product(a, a_dtype, b, b_dtype)
        self.rows_, self.cols_ = rows or (0, w.shape[0]), cols or (0, w.shape[1])
        m, n = self.rows_[1] - self.rows_[0], self.cols_[1] - self.cols_[0]
        self.shape, self.dtype = ((n, m) if transposed else (m, n)), w.dtype

    def _narrowed(self, rows, cols, transposed) -> "MergedArray":
        a, a_dtype, b, b_dtype = self.product.ab
        return MergedArray(self.w, self.w_dtype, a, a_dtype, b, b_dtype, self.scaling, transposed, self.product,
                           rows, cols)

    def rows(self, r0: int, r1: int) -> "MergedArray":
        if self.transposed:  # rows of the transpose: columns of W
            c = self.cols_[0]
            return self._narrowed(self.rows_, (c + r0, c + r1), True)
        r = self.rows_[0]
        return self._narrowed((r + r0, r + r1), self.cols_, False)

    def transpose(self, *axes):
        axes = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else axes
        if axes not in ((1, 0), ()):
            return super().transpose(*axes)
        return self._narrowed(self.rows_, self.cols_, not self.transposed)

    @property
    def T(self):
        return self.transpose()

    def fill(self, out: np.ndarray) -> None:
        (r0, r1), (c0, c1) = self.rows_, self.cols_
        tmp = scratch((r1 - r0) * (c1 - c0) * 4, "merge").view(np.float32).reshape(r1 - r0, c1 - c0)
        np.multiply(self.product.get()[r0:r1, c0:c1], np.float32(self.scaling), out=tmp)  # as merged_block: the
        tmp += as_float32(self.w[r0:r1, c0:c1], self.w_dtype)  # scalar, then W, one rounding each
        cast_into(out, tmp.T if self.transposed else tmp, "float32", self.w_dtype)


__all__ = ["MergedArray", "as_float32", "delta_hf", "merged_block"]
