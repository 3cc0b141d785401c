"""The FP8 layout of a snapshot, checked: every quantized weight has its scale, shapes agree, config.json says so.

A snapshot has the layout when a tensor is ``F8_E4M3``, a tensor is named ``*_scale_inv``, or config.json's
``quantization_config`` names ``fp8``. Then (``plan/quantization.py`` states the layout):

- config.json's ``quantization_config`` is ``quant_method: fp8`` with ``weight_block_size`` two positive
  integers ``[b0, b1]`` (``fmt``, if given, ``e4m3``; ``modules_to_not_convert``, if given, a list of
  module names none of which is quantized);
- every ``F8_E4M3`` tensor ``W`` is 2-D and has ``W + "_scale_inv"``, ``F32`` of shape
  ``[ceil(out / b0), ceil(in / b1)]``;
- every ``*_scale_inv`` tensor belongs to an ``F8_E4M3`` tensor.

Every flaw goes to the report, nothing is raised.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...plan.quantization import SCALE_SUFFIX as SUFFIX, scale_name, scale_shape
from ..write.header import short
from .paths import Unreadable, json_kind

FP8, SCALE = "F8_E4M3", "F32"


def declares_fp8(config) -> bool:
    """Whether config.json (a parsed object, or anything read in its place) says the snapshot is FP8."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


def _block(qc, report) -> Optional[tuple]:
    """The block of config.json's quantization_config, or None (reported) when it does not describe FP8."""
    if not isinstance(qc, dict):
        report.fail("config.json: the snapshot has FP8 tensors but no quantization_config object" if qc is None else
                    f"config.json: quantization_config is {json_kind(qc)}, not an object")
        return None
    if qc.get("quant_method") != "fp8":
        report.fail(f"config.json: quantization_config.quant_method is {short(qc.get('quant_method'))}, not 'fp8'")
        return None
    if "fmt" in qc and qc["fmt"] != "e4m3":
        report.fail(f"config.json: quantization_config.fmt is {short(qc['fmt'])}, not 'e4m3'")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        report.fail(f"config.json: quantization_config.weight_block_size is {short(block)}, not two positive integers")
        return None
    return tuple(block)


def check_fp8(snap, entries: Dict[str, object], report) -> Optional[Tuple[Tuple[int, int], List[str]]]:
    """``entries``: every tensor's header entry (name -> ``HeaderEntry``) of the snapshot's files. Returns the block
    and the FP8 weights whose layout is right (each with its F32 scale of the grid's shape), for the check of their
    bytes (``fp8_blocks.py``); None where the snapshot has no FP8 layout or no valid block."""
    fp8 = {n: e for n, e in entries.items() if e.dtype == FP8}
    scales = {n: e for n, e in entries.items() if n.endswith(SUFFIX)}
    try:
        config = snap.read_json("config.json") if "config.json" in snap.names() else None
    except Unreadable as e:
        if fp8 or scales:
            report.fail(f"config.json: {e}")
        return None
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if not (fp8 or scales or declares_fp8(config)):
        return None
    if not fp8:
        report.fail("config.json: quantization_config says fp8, but no tensor is F8_E4M3")
    block = _block(qc, report)
    good: List[str] = []
    for name, e in sorted(fp8.items()):
        if len(e.shape) != 2:
            report.fail(f"{short(name)}: F8_E4M3 {list(e.shape)}: an FP8 weight is 2-D [out, in]")
            continue
        s = entries.get(scale_name(name))
        if s is None:
            report.fail(f"{short(name)}: F8_E4M3 without its scale {short(scale_name(name))}")
            continue
        if s.dtype != SCALE:
            report.fail(f"{short(scale_name(name))}: {s.dtype}, the layout's scales are F32")
        if block is not None and tuple(s.shape) != scale_shape(e.shape, block):
            report.fail(f"{short(scale_name(name))}: {list(s.shape)}, expected {list(scale_shape(e.shape, block))} for "
                        f"{list(e.shape)} in blocks of {list(block)}")
        elif block is not None and s.dtype == SCALE:
            good.append(name)
    for name in sorted(scales):
        owner = name[:-len(SUFFIX)]
        if owner not in fp8:
            report.fail(f"{short(name)}: a scale of {short(owner)}, which is "
                        f"{'missing' if owner not in entries else entries[owner].dtype + ', not F8_E4M3'}")
    skip = qc.get("modules_to_not_convert") if isinstance(qc, dict) else None
    if skip is not None:
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            report.fail(f"config.json: quantization_config.modules_to_not_convert is {short(skip)}, not a list of names")
        else:
            wrong = sorted(m for m in skip if m + ".weight" in fp8)
            if wrong:
                report.fail(f"config.json: modules_to_not_convert lists {wrong[:3]}, whose weights are F8_E4M3")
    return (block, good) if block is not None else None


__all__ = ["check_fp8", "declares_fp8"]
