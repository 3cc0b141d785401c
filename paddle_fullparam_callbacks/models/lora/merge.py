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

bfloat16 and float16 weights are merged in float32 and cast back once (by the caller, with Paddle's
cast); adapters kept in those dtypes are widened to float32 first (exactly), as peft does on CPU.
"""
from __future__ import annotations

import numpy as np

from ... import _dtypes


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


__all__ = ["as_float32", "delta_hf", "merged_block"]
