"""The arithmetic of a LoRA merge, on host arrays: ``W + s * A @ B`` for one block of ``W``.

Paddle stores a LoRA layer as ``W [in, out]``, ``lora_A [in, r]``, ``lora_B [r, out]`` and computes
``x @ W + (x @ A @ B) * s``. The merged weight, in float32, is three roundings, each with one stated
result, so its bits depend on the inputs alone (not on the machine's BLAS, its threads or its CPU):

1. ``P = A @ B`` by ``product.py``'s rule: each element the float32 nearest the exact sum of its r
   products;
2. ``D = P * float32(s)``, rounded (the scalar after the product, as peft applies it);
3. ``W + D``, rounded.

peft's ``merge_and_unload()`` computes the same three steps, but its step 1 is torch's float32 matmul,
whose bits are its BLAS kernel's: the two agree to within that matmul's rounding (a few float32 ulps of
``sum |a||b|``; ``tests/hf_client/check_lora.py`` checks the bound and this rule, bit for bit), not
bit for bit on every machine. Paddle's own merge (``W + paddle.matmul(A, B) * s``) is a third rounding
of the same sum (docs/models.md, "LoRA").

A block is merged alone: r is never split over ranks, so the block of ``W`` a tensor-parallel rank
holds merges with the rows of ``A`` and the columns of ``B`` it holds, and by the rule each element is
the same as in the whole tensor's merge.

bfloat16 and float16 weights are merged in float32 and cast back once (with Paddle's bits); adapters
kept in those dtypes are widened to float32 first (exactly), as peft does on CPU.

At export, a merge is a :class:`MergedArray`: computed block by block on the worker threads where it
is written (``host/lazy.py``).
"""
from __future__ import annotations

import numpy as np

from ... import _dtypes
from ...host.casts import cast_into, scratch
from ...host.copy import copy_into
from ...host.lazy import LazyArray
from .product import exact_product


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
    """``(B^T @ A^T) * float32(scaling)``: the update in torch's ``[out, in]`` layout, float32, by the
    module's rule (the exact sum does not depend on the order of its terms, so this is
    :func:`merged_block`'s update transposed, bit for bit).

    >>> a = np.array([[1.0], [2.0]], np.float32); b = np.array([[3.0, 4.0, 5.0]], np.float32)
    >>> delta_hf(a, b, 0.5).tolist()
    [[1.5, 3.0], [2.0, 4.0], [2.5, 5.0]]
    """
    out = exact_product(b.T, a.T)  # [out, r] @ [r, in]
    out *= np.float32(scaling)
    return out


def merged_block(w: np.ndarray, w_dtype: str, a: np.ndarray, a_dtype: str, b: np.ndarray, b_dtype: str,
                 scaling: float) -> np.ndarray:
    """The merged block ``W + s * A @ B`` in Paddle's ``[in, out]`` layout, float32, C-contiguous.

    ``w`` ``[m, n]`` is a block of the weight, ``a`` ``[m, r]`` the matching rows of ``lora_A``, ``b``
    ``[r, n]`` the matching columns of ``lora_B`` (each as storage of its Paddle dtype).

    Computed in Paddle's layout (one new array, updated in place; the writer transposes it as it
    transposes any weight), by the module's three steps.

    >>> w = np.zeros((2, 3), np.float32); a = np.ones((2, 1), np.float32); b = np.ones((1, 3), np.float32)
    >>> merged_block(w, "float32", a, "float32", b, "float32", 2.0).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    r = a.shape[1]
    if a.shape[0] != w.shape[0] or b.shape != (r, w.shape[1]):
        raise ValueError(f"LoRA block shapes do not fit: W {list(w.shape)}, A {list(a.shape)}, B {list(b.shape)}")
    out = exact_product(as_float32(a, a_dtype), as_float32(b, b_dtype))
    out *= np.float32(scaling)  # the scalar after the product, as float32: peft's (B^T @ A^T) * scaling
    out += as_float32(w, w_dtype)  # W + delta: one rounding, commutative
    return out


class MergedArray(LazyArray):
    """``W + s * A @ B`` in ``w_dtype`` with :func:`merged_block`'s bits, computed where it is consumed, a
    block at a time (the block's own rows of ``A`` and columns of ``B``: by the product's rule a block is
    the whole merge's block, bit for bit): in Paddle's ``[in, out]`` layout, or ``transposed`` (Hugging
    Face's ``[out, in]``). Nothing is computed, or held, ahead of the writer."""

    def __init__(self, w, w_dtype: str, a, a_dtype: str, b, b_dtype: str, scaling: float,
                 transposed: bool = False, rows=None, cols=None):
        r = a.shape[1]
        if a.shape[0] != w.shape[0] or b.shape != (r, w.shape[1]):
            raise ValueError(f"LoRA block shapes do not fit: W {list(w.shape)}, A {list(a.shape)}, B {list(b.shape)}")
        as_float32(a[:0], a_dtype), as_float32(b[:0], b_dtype)  # an unmergeable dtype is refused here, not on a worker
        self.w, self.w_dtype, self.scaling, self.transposed = w, w_dtype, scaling, transposed
        self.ab = (a, a_dtype, b, b_dtype)
        self.rows_, self.cols_ = rows or (0, w.shape[0]), cols or (0, w.shape[1])
        m, n = self.rows_[1] - self.rows_[0], self.cols_[1] - self.cols_[0]
        self.shape, self.dtype = ((n, m) if transposed else (m, n)), w.dtype

    def _narrowed(self, rows, cols, transposed) -> "MergedArray":
        a, a_dtype, b, b_dtype = self.ab
        return MergedArray(self.w, self.w_dtype, a, a_dtype, b, b_dtype, self.scaling, transposed, rows, cols)

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
        a, a_dtype, b, b_dtype = self.ab
        a, b = as_float32(a[r0:r1], a_dtype), as_float32(b[:, c0:c1], b_dtype)
        direct = self.w_dtype == "float32" and out.dtype == np.float32 and out.flags.c_contiguous
        if direct:  # computed in the writer's buffer: no temporary, no copy
            tmp = out
        else:
            tmp = scratch(out.size * 4, "merge").view(np.float32).reshape(out.shape)
        w = as_float32(self.w[r0:r1, c0:c1], self.w_dtype)
        if self.transposed:  # the product in the layout written ([out, in]): B^T @ A^T, the same exact sums
            exact_product(b.T, a.T, out=tmp)
            w = w.T
        else:
            exact_product(a, b, out=tmp)
        tmp *= np.float32(self.scaling)  # as merged_block: the scalar, then W, one rounding each
        copy_into(tmp, w, add=True)  # W's transpose added from a cache-sized stage, as the plain export copies it
        if not direct:
            cast_into(out, tmp, "float32", self.w_dtype)


__all__ = ["MergedArray", "as_float32", "delta_hf", "merged_block"]
