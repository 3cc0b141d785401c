"""What an FP8 weight's own bytes prove: each scaled block holds a code of magnitude 448 (issue 46).

The rule (``host/fp8.py``, transformers' ``Fp8Quantize``) scales each block by ``448 / max_abs``, so the block's
largest magnitude becomes 448 (the product is within a rounding of it, and any value from 432 up rounds or clamps
to 448): every block whose scale is finite, nonzero and not 1 holds at least one byte ``0x7E`` or ``0xFE``. In
terms of the stored ``weight_scale_inv`` (``1 / scale``): a value that is finite, positive and not 1. The other
values the rule gives are 1 (a block of zeros or with a NaN), 0 (subnormal maxima: scale infinite) and +inf (a block
with an infinity: scale 0), and nothing else: a negative or NaN ``weight_scale_inv`` is reported too.

A block that breaks the invariant was not made by the rule: e4m3 bytes that a chunked loop never wrote (what
issue 46 found in real layer shapes), bytes damaged after they were hashed, scales that do not belong to the
weight. Its scale and layout can be right, so the layout checks (``quantized.py``) do not see it. The bytes are
read a block row at a time (a few MB), never mapped: a file truncated meanwhile is an error, not a crash.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np

from ...plan.quantization import scale_name
from ..write.header import short

MAX_BLOCKS_NAMED = 3  # blocks named per tensor; the rest are counted


def check_blocks(snap, located: Dict[str, Tuple[str, int, object]], weights, block, report) -> None:
    """``located``: tensor name -> (file name, the file's data start, its header entry); ``weights``: the FP8
    weights whose layout is right (each with an F32 scale of the block grid's shape); ``block``: (b0, b1)."""
    for name in weights:
        try:
            _check_weight(snap, name, located[name], located[scale_name(name)], block, report)
        except OSError as e:
            report.fail(f"{short(name)}: cannot be read ({e.strerror or e})")


def _read(f, where: Tuple[str, int, object], begin: int, n: int) -> bytes:
    """``n`` bytes at ``begin`` of the data section of ``where``'s file, open as ``f``."""
    fname, start, _ = where
    data = os.pread(f.fileno(), n, start + begin)
    if len(data) != n:
        raise OSError(0, f"{fname} ended before byte {start + begin + n}")
    return data


def _check_weight(snap, name: str, weight, scale, block, report) -> None:
    rows, cols = weight[2].shape
    b0, b1 = block
    with snap.open_file(scale[0]) as f:
        inv = np.frombuffer(_read(f, scale, scale[2].begin, scale[2].end - scale[2].begin), "<f4").reshape(
            scale[2].shape)
    with np.errstate(invalid="ignore"):
        strange = ~((inv >= 0) | np.isposinf(inv))  # negative or NaN: no block's scale under the rule
        scaled = np.isfinite(inv) & (inv > 0) & (inv != 1)
    starts = np.arange(0, cols, b1)
    bad = []
    with snap.open_file(weight[0]) as f:  # once per weight: read a block row at a time
        for g in range(inv.shape[0]):
            if not scaled[g].any():
                continue
            r0, r1 = g * b0, min(rows, (g + 1) * b0)
            q = np.frombuffer(_read(f, weight, weight[2].begin + r0 * cols, (r1 - r0) * cols), np.uint8)
            top = (np.bitwise_and(q, 0x7F) == 0x7E).reshape(r1 - r0, cols).any(axis=0)  # a +-448 in each column?
            has = np.logical_or.reduceat(top, starts) if cols else np.zeros(0, bool)
            bad.extend((g, int(j)) for j in np.flatnonzero(scaled[g] & ~has))
    for g, j in zip(*np.nonzero(strange)):
        report.fail(f"{short(name)}: block [{g}, {j}] has weight_scale_inv {float(inv[g, j])!r}, which the rule never "
                    "gives (its scales' inverses are positive, 0 or +inf)")
    for g, j in bad[:MAX_BLOCKS_NAMED]:
        report.fail(f"{short(name)}: block [{g}, {j}] (rows {g * b0}:{min(rows, (g + 1) * b0)}, columns "
                    f"{j * b1}:{min(cols, (j + 1) * b1)}) has weight_scale_inv {float(inv[g, j]):.6g} but no e4m3 code "
                    "of magnitude 448: the rule maps each block's largest magnitude to 448, so these bytes were not "
                    "made by it (unwritten or damaged bytes, or scales of another weight)")
    if len(bad) > MAX_BLOCKS_NAMED:
        report.fail(f"{short(name)}: ... and {len(bad) - MAX_BLOCKS_NAMED} more blocks without a code of magnitude 448")


__all__ = ["MAX_BLOCKS_NAMED", "check_blocks"]
