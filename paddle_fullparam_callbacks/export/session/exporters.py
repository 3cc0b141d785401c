"""Exporters: what happens to each full tensor. One small interface, three implementations.

``begin(plan, staging_dir)`` once, ``write(name, tensor)`` per tensor, then ``finish()`` (returns
the files written, for the manifest) or ``abort()`` (removes whatever was written).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Dict, Optional

from ...assemble.arrays import to_paddle
from ...config.schema import ConfigError
from ...host.quantize import Fp8Weight
from ...plan.export_plan import ExportPlan
from ..write.writer import FileResult, SnapshotWriter
from .host import detached_copy, plain_array, to_host_array, with_zero_row


class Exporter:
    """Base class. ``writes_files`` says whether a snapshot directory is committed."""

    writes_files = True
    uses_mapping = True

    def begin(self, plan: ExportPlan, staging_dir: Optional[Path], step: int, file_indices=None, fp8=None) -> None:
        """``file_indices``: the files this rank writes (None: all); ``fp8``: the weights stored as FP8
        (``plan.quantization.Fp8Plan``), quantized here from the tensors handed to :meth:`write`."""
        raise NotImplementedError

    def write(self, name: str, tensor, zero_row: Optional[int] = None) -> None:
        """``zero_row``: a row (first axis) exported as zeros (an embedding's padding row)."""
        raise NotImplementedError

    def wait_for_room(self, nbytes: int) -> None:
        """Block until a tensor of ``nbytes`` can be written without waiting: called before a producer
        that reads tensors on demand (``convert``) reads the next one. Nothing to wait for by default."""

    def host_alloc(self):
        """Where the device boundary should put the slices it copies off the device, so that this exporter
        takes them as they are: ``(shape, dtype) -> array or None``, or None (ordinary arrays)."""
        return None

    def finish(self) -> Dict[str, FileResult]:
        raise NotImplementedError

    def abort(self) -> None:
        pass


class SafetensorsExporter(Exporter):
    """Sharded safetensors files following the plan, through the streaming writer."""

    def __init__(self, max_pending_bytes: int, background: bool = True, copy: bool = False, ring=None,
                 threads="auto"):
        self.max_pending_bytes = max_pending_bytes
        self.background = background
        self.threads = threads  # export.threads: the worker pool that copies, casts, merges and hashes
        self.copy = copy  # async: training resumes before the bytes are on disk, so hand over a copy
        self.ring = ring  # reusable host memory for those copies (HostRing), if any
        self.writer: Optional[SnapshotWriter] = None
        self.fp8 = None

    def begin(self, plan, staging_dir, step, file_indices=None, fp8=None):
        self.fp8 = fp8
        self.writer = SnapshotWriter(plan, staging_dir, file_indices, max_pending_bytes=self.max_pending_bytes,
                                     background=self.background, threads=self.threads)

    def wait_for_room(self, nbytes: int) -> None:
        self.writer.wait_for_room(nbytes)  # until it could take nbytes more within its budget (or is idle)

    def host_alloc(self):
        """A background export's staging ring: a slice leaves the device straight into it."""
        return self.ring.array if self.copy and self.ring is not None else None

    def write(self, name, tensor, zero_row=None):
        arr = to_host_array(tensor)
        q = self.fp8.weights.get(name) if self.fp8 is not None else None
        if q is not None:
            if zero_row is not None:
                raise ValueError(f"tensor {name!r}: a weight stored as FP8 has no padding row to zero")
            # the scales now (one read of the weight, on the workers), the e4m3 bytes where the writer makes them;
            # the scale goes first: stored after the file's other tensors (plan.export_plan.storage_order), it waits
            # in the writer's stash (a few KB) while the weight is written in order; where it is stored first (an
            # unaligned file), it is written at once, ahead of its weight
            fp8 = Fp8Weight(arr, q.dtype, q.block)
            self._put(q.scale, fp8.scale_inv)
            self._put(name, fp8.weight)
            return
        self._put(name, arr, zero_row)

    def _put(self, name, arr, zero_row=None):
        release = None
        if self.copy and self.ring is not None and self.ring.holds(arr):  # in the ring already: as it is
            self.ring.label(arr, name)
        elif self.copy:
            copied, release = (self.ring.copy_in(arr, key=name, may_wait=self._ring_frees) if self.ring is not None
                               else (None, None))
            arr = copied if copied is not None else detached_copy(arr)
        self.writer.put(name, arr, release, zero_row=zero_row)  # the writer zeroes the row: no copy

    def _ring_frees(self, token) -> bool:
        """Whether the writer frees a ring allocation without more tensors: it holds a tensor handed over whose
        file's earlier tensors have all been handed over (one kept for later, waiting for a tensor not handed
        over yet, is not: waiting for it would wait for ``HostRing.wait_s``)."""
        return token[3] is not None and self.writer.will_write(token[3])

    def finish(self):
        return self.writer.close()

    def abort(self):
        if self.writer is not None:
            self.writer.abort()

    @property
    def peak_pending_bytes(self) -> int:
        return self.writer.peak_pending_bytes if self.writer else 0


class HFSafetensorsExporter(SafetensorsExporter):
    """Hugging Face names and layout (after the name mapping), plus config and tokenizer files."""


class PaddleSafetensorsExporter(SafetensorsExporter):
    """Paddle names and layout, no mapping: loads back with ``set_state_dict`` on an unsharded model."""

    uses_mapping = False


class CallableExporter(Exporter):
    """Hands every full tensor to ``fn(name, tensor, step=step)``; writes no snapshot. The tensor is a
    CPU Paddle tensor in host memory (assembled there, whatever device the parameters are on)."""

    writes_files = False

    def __init__(self, fn: Callable):
        self.fn = fn
        self.step = None
        self.plan: Optional[ExportPlan] = None

    def begin(self, plan, staging_dir, step, file_indices=None, fp8=None):
        self.step, self.plan = step, plan

    def write(self, name, tensor, zero_row=None):
        arr = with_zero_row(tensor, zero_row) if zero_row is not None else plain_array(tensor)
        self.fn(name, to_paddle(arr, self.plan.slots[name].dtype), step=self.step)

    def finish(self):
        return {}


def load_callable(spec: str) -> Callable:
    """'package.module:function' -> the function (imported, never evaluated); a ConfigError naming
    export.callable if it cannot be imported or is not callable (checked when the job starts)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # the user's module may fail to import in any way
        raise ConfigError("export.callable", f"{spec!r} cannot be imported: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ConfigError("export.callable", f"{spec!r} is a {type(obj).__name__}, not a function")
    return obj


def make_exporter(export_cfg, fn: Optional[Callable] = None, ring=None) -> Exporter:
    """The exporter of ``export.format``. ``ring``: the async staging ring (HostRing), if any.

    The writer's ``put`` waits once the bytes queued reach half its budget (the other half is for
    out-of-order tensors): with a ring, an async export's budget is at least twice the ring, so the
    ring, sized for this rank's bytes, is what bounds it, not export.max_pending (512MB with auto)."""
    fmt = export_cfg.format
    budget = export_cfg.max_pending
    if export_cfg.async_write and ring is not None:
        budget = max(budget, 2 * ring.size)
    if fmt == "hf_safetensors":
        return HFSafetensorsExporter(budget, copy=export_cfg.async_write, ring=ring, threads=export_cfg.threads)
    if fmt == "paddle_safetensors":
        return PaddleSafetensorsExporter(budget, copy=export_cfg.async_write, ring=ring, threads=export_cfg.threads)
    if fmt == "callable":
        return CallableExporter(fn or load_callable(export_cfg.callable))
    raise ValueError(f"unknown export.format {fmt!r}")
