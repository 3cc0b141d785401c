"""The device boundary: the one place an export touches accelerator memory.

A rank's slices may live on an accelerator (a GPU, or any custom device Paddle loads). The export
moves them to host memory here, and everything after (assembly, collectives, casts, LoRA merges,
hashing, writing) works on host arrays: the code the CPU tests run.

The rule (``export.device_memory_budget``): an export never holds more than the budget of new
device memory at any moment, whatever the model's largest tensor.

* A contiguous slice is copied by Paddle (``Tensor.copy_``) straight into the host array that assembly
  then uses, in one copy, or, on builds with CUDA, in chunks of its own memory (views of the parameter)
  through one reused staging buffer of pinned host memory (device-to-host copies run at full speed only
  into pinned memory). That costs no device memory at all.
* A cast to ``export.dtype`` runs on the device, chunk by chunk, when one chunk of the result fits
  in the budget: the host then receives fewer bytes and has no cast to do. Otherwise (budget 0, or
  a chunk would not fit) the raw bytes come over and the host casts them.
* A transpose to the snapshot's layout (a Linear weight of a mesh of one rank, ``[in, out]`` in
  Paddle, ``[out, in]`` in Hugging Face's files) runs on the device too, when a block of rows of the
  result (with its cast, if any) fits in the budget: each block is a strided view of the parameter made
  contiguous on the device (``contiguous``, a transpose kernel), cast there if asked, and copied out; the
  host receives the bytes in file order and its writer copies nothing. Otherwise, and on a device that
  has no ``contiguous`` kernel (the first refusal is remembered per device type), the raw bytes come
  over and the host's worker threads transpose them. In a background export (``background``) training
  waits for the device's transposes but not for the host's: there the transposed weights after the first
  are timed until 8 MB were, and where their transposes ran no faster than a host's (10 GB/s: a device
  that runs the kernel on the host CPU), the rest of the export leaves them to the host
  (:func:`transposes_pay`).
* A slice that is not contiguous (rare: a view made by a framework) is made contiguous on the
  device in row blocks that fit the budget; with a budget too small for one row it is refused with
  an error naming it, never copied past the budget.

A CPU tensor is not copied at all: the host array shares its memory (DLPack).

Where the host arrays go: new arrays (``np.empty``), or, where the export hands them to a background
writer (``export.async_write``), the export's pre-faulted staging ring (``host_alloc``): each slice then
leaves the device straight into its place there, and nothing copies it again before the writer reads it.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np

from .. import _dtypes
from ..host.poison import fresh

CHUNK_BYTES = 16 * 2**20  # bytes per device-to-host copy: large enough to run at copy speed
TIMED_BYTES = 8 * 2**20  # transposes timed (after the first weight) before a background export judges them
# bytes/s above any host's transposes (the writer's threads transpose float32 at about 2 GB/s here,
# docs/performance.md); a GPU's kernel returns at its launch (tens of GB/s for MB-sized weights, more so)
HOST_TRANSPOSE_RATE = 10e9
ALIGN = 512  # device allocators round each allocation up (CUDA's caching allocator to 512 bytes)
DEFAULT_STAGING = "auto"  # see DeviceBoundary.staging_buffer (tests set 'host' to run the staged path)

logger = logging.getLogger("paddle_fullparam_callbacks")


class DeviceBudgetError(RuntimeError):
    """Moving a slice off the device would allocate more device memory than the budget allows."""


def dtype_of(tensor) -> str:
    """The Paddle dtype name of a tensor (or of a numpy array: storage dtype, bfloat16 as uint16)."""
    if isinstance(tensor, np.ndarray):
        return "bfloat16" if tensor.dtype == np.uint16 else tensor.dtype.name
    return _dtypes.lookup(str(tensor.dtype)).name


def on_device(tensor) -> bool:
    """Whether ``tensor`` is a Paddle tensor in accelerator memory (not a host array or CPU tensor)."""
    if isinstance(tensor, np.ndarray):
        return False
    place = tensor.place
    return not (place.is_cpu_place() or place.is_cuda_pinned_place())


def _cpu_array(tensor) -> np.ndarray:
    """A numpy array sharing a CPU tensor's memory, strides included (DLPack); a copy where DLPack
    refuses it."""
    import paddle

    if not tensor.stop_gradient:
        tensor = tensor.detach()  # Paddle refuses DLPack on tensors that require grad; detach() shares the memory
    storage = np.dtype(_dtypes.lookup(dtype_of(tensor)).np_storage)
    try:
        arr = np.from_dlpack(tensor.view(paddle.uint16) if storage == np.uint16 else tensor)
        if arr.dtype == storage and tuple(arr.shape) == tuple(tensor.shape):
            return arr
    except (TypeError, RuntimeError, ValueError, BufferError, AttributeError):
        pass
    arr = tensor.numpy()  # copies; always right
    return arr if arr.dtype == storage else arr.view(storage)


@dataclass
class DeviceStats:
    """What the boundary did during one export (the manifest's ``timings.device_to_host_s``, the tests)."""

    d2h_bytes: int = 0
    d2h_s: float = 0.0
    d2h_copies: int = 0  # copies off the device (Paddle calls: each has a fixed cost besides its bytes)
    device_casts: int = 0
    host_casts: int = 0
    device_transposes: int = 0  # tensors transposed on the device (in row blocks)


@dataclass
class DeviceBoundary:
    """Moves slices to host memory within ``budget`` bytes of device memory (see the module doc)."""

    budget: int = 0
    chunk_bytes: int = field(default_factory=lambda: CHUNK_BYTES)
    staging: str = field(default_factory=lambda: DEFAULT_STAGING)
    stats: DeviceStats = field(default_factory=DeviceStats)
    host_alloc: Optional[Callable[[tuple, np.dtype], Optional[np.ndarray]]] = None
    """(shape, dtype) -> a new C-contiguous host array, or None for an ordinary one: where device slices
    land (the staging ring of a background export: ``export/session/host.HostRing.array``)."""
    background: bool = False
    """The host arrays go to a background writer (``export.async_write``): training waits for the copies
    off the device, not for the writer. Transposes then stay on the device only while they are faster than
    a host's (:func:`transposes_pay`)."""
    _host_transposes: bool = field(default=False, repr=False)  # judged no faster than a host: the writer transposes
    _timed: Optional[list] = field(default_factory=lambda: [0.0, 0], repr=False)  # transposes: seconds, bytes

    def _new(self, shape, storage) -> np.ndarray:
        out = self.host_alloc(tuple(shape), np.dtype(storage)) if self.host_alloc is not None else None
        return fresh(np.empty(tuple(shape), dtype=storage)) if out is None else out

    # ---- whole slices ---------------------------------------------------------------------
    def host_array(self, tensor, cast_to: Optional[str] = None,
                   transposed: bool = False) -> "tuple[np.ndarray, str]":
        """``(array, dtype)``: the tensor's values in host memory, cast to ``cast_to`` when given
        (floating dtypes only). A host array or CPU tensor is shared, not copied (unless cast).

        ``transposed``: the caller will read the (2-D) array transposed; a device tensor is then
        transposed on the device where the budget allows, and the array comes back as the transpose of
        a contiguous host array (its values as asked, its memory already in the transposed order)."""
        dtype = dtype_of(tensor)
        want = cast_to if self._casts(dtype, cast_to) else dtype
        if isinstance(tensor, np.ndarray) or not on_device(tensor):
            return self._host_cast(tensor if isinstance(tensor, np.ndarray) else _cpu_array(tensor), dtype, want), want
        if transposed and len(tensor.shape) == 2:
            out = self._transposed_out(tensor, dtype, want)
            if out is not None:
                return out.T, want
        device_cast = want != dtype and self._fits(_dtypes.lookup(want).itemsize)
        moved = want if device_cast else dtype  # what crosses to the host
        storage = _dtypes.lookup(moved).np_storage
        # (the ring only for bytes that go to the writer as they are: a host cast's source would hold ring room
        # while its result waits for some)
        out = self._new(tensor.shape, storage) if moved == want else np.empty(tuple(tensor.shape), dtype=storage)
        self._copy_out(tensor, out, want if device_cast else None)
        return self._host_cast(out, moved, want), want

    def _casts(self, dtype: str, cast_to: Optional[str]) -> bool:
        return bool(cast_to) and cast_to != dtype and _dtypes.lookup(dtype).is_float and _dtypes.lookup(cast_to).is_float

    def _host_cast(self, arr: np.ndarray, dtype: str, want: str):
        """The cast on the host: a lazy array (``host.lazy.CastArray``), computed block by block on the
        worker threads where it is consumed (the writer's copy buffers), never as a whole new tensor."""
        from .arrays import lazy_cast

        if want == dtype:
            return arr
        self.stats.host_casts += 1
        return lazy_cast(arr, dtype, want)

    def _usable(self) -> int:
        """Bytes one device allocation may ask for so that, rounded up by the allocator, it fits the budget."""
        return (min(self.budget, self.chunk_bytes) // ALIGN) * ALIGN

    def _fits(self, itemsize_out: int) -> bool:
        """A device-side cast needs at least one chunk of the result (a few thousand elements) within the budget."""
        return self._usable() >= min(self.chunk_bytes, 4096 * itemsize_out)

    # ---- transposes on the device -------------------------------------------------------------
    def _transposed_out(self, tensor, dtype: str, want: str) -> Optional[np.ndarray]:
        """``tensor.T`` (cast to ``want``) as a contiguous host array, made on the device in row blocks
        within the budget; None where one row does not fit or the device cannot transpose."""
        m, n = (int(d) for d in tensor.shape)
        if not m or not n or self._host_transposes or str(tensor.place).split(":")[0] in _NO_TRANSPOSE:
            return None
        item, item_out = _dtypes.lookup(dtype).itemsize, _dtypes.lookup(want).itemsize
        # per row of the result: the transposed block, a copy of the strided slice where a device makes
        # slices by copying (stride kernels off), and the cast block
        per_row = m * (2 * item + (item_out if want != dtype else 0))
        rows = self._usable() // per_row
        if rows < 1:
            return None
        t0 = time.perf_counter()
        if not tensor.stop_gradient:
            tensor = tensor.detach()
        out = None  # made once the device transposed a first block: a refusal leaves no gap in the staging ring
        transpose_s = 0.0
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            t = time.perf_counter()
            try:
                block = tensor[:, r0:r1].transpose([1, 0]).contiguous()  # a transpose kernel on the device
            except (RuntimeError, NotImplementedError, ValueError, OSError) as e:
                if r0:
                    raise
                _NO_TRANSPOSE.add(str(tensor.place).split(":")[0])  # no such kernel there: the host transposes
                logger.debug("no transpose on %s (%s): transposes run on the host", tensor.place, e)
                return None
            transpose_s += time.perf_counter() - t
            if out is None:
                out = self._new((n, m), _dtypes.lookup(want).np_storage)
            if want != dtype:
                block = block.astype(want)
                self.stats.device_casts += 1
            self._to_host(block.reshape([-1]), out[r0:r1].reshape(-1))
            del block
        self.stats.device_transposes += 1
        if self.background and self.stats.device_transposes > 1:  # (the first may carry the kernel's one-time setup)
            self._judge_transposes(tensor.place, transpose_s, m * n * item)
        self.stats.d2h_bytes += out.nbytes
        self.stats.d2h_s += time.perf_counter() - t0
        return out

    def _judge_transposes(self, place, transpose_s: float, nbytes: int) -> None:
        """A background export's verdict on its device's transposes, once TIMED_BYTES of them were timed (after the
        first weight): where they ran no faster than a host's (:func:`transposes_pay`), the rest of the export
        leaves them to the writer's threads."""
        timed = self._timed
        if timed is None:
            return
        timed[0], timed[1] = timed[0] + transpose_s, timed[1] + nbytes
        if timed[1] < TIMED_BYTES:
            return
        self._timed = None
        if not transposes_pay(timed[0], timed[1]):
            self._host_transposes = True
            _say_once(f"host-transposes:{str(place).split(':')[0]}", "transposes on %s ran at %.2f GB/s (%.0f MB in "
                      "%.1f ms), no faster than a host's: background exports leave the Linear weights' transposes to "
                      "the writer's threads", place, timed[1] / max(timed[0], 1e-9) / 1e9, timed[1] / 2**20,
                      timed[0] * 1e3)

    # ---- the copy -------------------------------------------------------------------------
    def _copy_out(self, tensor, out: np.ndarray, cast_to: Optional[str]) -> None:
        """Fill ``out`` (host, C-contiguous, the result dtype's storage) with ``tensor``'s values."""
        t0 = time.perf_counter()
        if not tensor.stop_gradient:
            tensor = tensor.detach()
        if not math.prod(tensor.shape):  # (numel() would be a new tensor, on the device)
            return
        if not tensor.is_contiguous():
            self._copy_strided(tensor, out, cast_to)
        elif cast_to is None and len(tensor.shape) and self._staging_mode() == "none":
            # straight into ``out``, no device memory either way: one copy, not one per chunk (each copy off a
            # custom device costs Paddle a stream object with a thread of its own, made and joined: measured
            # 0.07-0.35 ms per call here, more when the cores are busy)
            self._to_host(tensor, out)
        else:
            self._copy_flat(tensor.reshape([-1]), out.reshape(-1), cast_to)  # (reshape of contiguous: a view)
        self.stats.d2h_bytes += out.nbytes
        self.stats.d2h_s += time.perf_counter() - t0

    def _copy_flat(self, flat, out: np.ndarray, cast_to: Optional[str]) -> None:
        """A contiguous 1-D device tensor into ``out`` (1-D host, the result's storage), chunk by chunk:
        each chunk a view of ``flat``, copied in its own dtype."""
        n = int(flat.shape[0])
        item = _dtypes.lookup(cast_to or dtype_of(flat)).itemsize
        step = max(1, (self._usable() if cast_to else self.chunk_bytes) // item)
        for start in range(0, n, step):
            piece = flat[start:min(n, start + step)]
            if cast_to:
                piece = piece.astype(cast_to)
                self.stats.device_casts += 1
            self._to_host(piece, out[start:start + int(piece.shape[0])])
            del piece

    def _to_host(self, piece, dest: np.ndarray) -> None:
        """One contiguous device chunk into ``dest`` (a host array of its storage dtype and size): copied by
        Paddle into the destination's own memory, or through the reused staging buffer where there is one.

        Never through a dtype view of the chunk (``piece.view(paddle.uint8)``): in Paddle 3.3.1 ``view`` to a
        dtype of another size scales the storage offset of a sliced tensor by the size ratio (a chunk at
        byte 16 MB of a float32 tensor, viewed as uint8, points at byte 64 MB: a segmentation fault on the
        fake accelerator, a refusal on the CPU). Host arrays are seen as tensors of the chunk's own dtype
        instead, each at offset 0 of its own memory."""
        from .arrays import to_paddle

        dtype = dtype_of(piece)
        self.stats.d2h_copies += 1
        stage = self.staging_buffer(dest.nbytes)
        if stage is None:
            to_paddle(dest, dtype).copy_(piece, True)
            return
        window = stage[:dest.nbytes]  # offset 0: a dtype view of it is sound
        window = window.view(_paddle_dtype(dtype)) if dtype != "uint8" else window
        window.copy_(piece, True)  # device -> staging (pinned: the fast, DMA-able kind of host memory)
        to_paddle(dest, dtype).copy_(window, True)  # staging -> destination: a host copy

    def staging_buffer(self, nbytes: int):
        """The staging buffer (a uint8 host tensor of ``chunk_bytes``, made once per process and reused),
        or None: the chunks then go straight into their destination. ``staging``: 'auto' (pinned host
        memory where Paddle has it: builds with CUDA), 'pinned', 'host' (ordinary host memory: the same
        two copies, for the tests of this path on other devices) or 'none'."""
        mode = self._staging_mode()
        if mode == "none" or nbytes > self.chunk_bytes:
            return None
        key = (mode, self.chunk_bytes)
        if key not in _STAGING:
            import paddle

            host = paddle.to_tensor(np.zeros(self.chunk_bytes, dtype=np.uint8), place=paddle.CPUPlace())
            _STAGING[key] = host.pin_memory() if mode == "pinned" else host
        return _STAGING[key]

    def _staging_mode(self) -> str:
        """``staging`` with 'auto' resolved: 'pinned' on builds with CUDA, 'none' elsewhere."""
        if self.staging != "auto":
            return self.staging
        import paddle

        return "pinned" if paddle.is_compiled_with_cuda() else "none"

    def _copy_strided(self, tensor, out: np.ndarray, cast_to: Optional[str]) -> None:
        """A non-contiguous slice (rare: a view a framework made). Paddle's ``numpy()`` copies a view to
        the host with its strides, without device memory; where it cannot, row blocks are made
        contiguous on the device, each within the budget. A cast then runs on the host."""
        try:
            values = tensor.numpy()
        except (RuntimeError, ValueError, OSError):
            values = None
        if values is None:
            rows = int(tensor.shape[0]) if tensor.ndim else 1
            row_bytes = max(1, math.prod(tensor.shape[1:]) * _dtypes.lookup(dtype_of(tensor)).itemsize)
            per = min(rows, ((self.budget // ALIGN) * ALIGN) // row_bytes)  # one allocation, rounded up, within the budget
            if per < 1:
                raise DeviceBudgetError(
                    f"a slice {list(tensor.shape)} of dtype {dtype_of(tensor)} is not contiguous on the device and "
                    f"cannot be copied as it is: making one row contiguous needs {row_bytes} bytes of device memory, "
                    f"more than export.device_memory_budget ({self.budget}); raise the budget")
            values = np.empty(tuple(tensor.shape), dtype=_dtypes.lookup(dtype_of(tensor)).np_storage)
            for start in range(0, rows, per):
                stop = min(rows, start + per)
                values[start:stop] = _host_values(tensor[start:stop].contiguous()).reshape(values[start:stop].shape)
        storage = np.dtype(_dtypes.lookup(dtype_of(tensor)).np_storage)
        values = values if values.dtype == storage else values.view(storage)
        if cast_to:
            from .arrays import cast_array

            self.stats.host_casts += 1
            values = cast_array(values, dtype_of(tensor), cast_to)
        out[...] = values.reshape(out.shape)


def _host_values(piece) -> np.ndarray:
    """A contiguous device tensor's values as a new host array of its storage dtype."""
    out = np.empty(tuple(piece.shape), dtype=_dtypes.lookup(dtype_of(piece)).np_storage)
    DeviceBoundary(0, staging="none")._to_host(piece, out)
    return out


def _paddle_dtype(name: str):
    import paddle

    return getattr(paddle, name)


_STAGING: Dict[tuple, object] = {}  # (mode, bytes) -> the process's staging buffer
_NO_TRANSPOSE: set = set()  # device types that refused a transpose (no contiguous kernel)
_SAID: set = set()


def transposes_pay(transpose_s: float, nbytes: int) -> bool:
    """Whether a background export keeps transposing on the device: ``nbytes`` of its weights were transposed
    in ``transpose_s`` (the time until the device's ``contiguous`` returned), faster than HOST_TRANSPOSE_RATE.
    Training waits for the device's transposes, not for the host's (the writer's threads, off the training
    thread). A GPU's transpose kernel returns at its launch and runs at hundreds of GB/s: it pays, and the
    writer then copies nothing; a device that transposes no faster than a host (one that runs the kernel on
    the host CPU, in the training thread) does not.

    >>> transposes_pay(0.0002, 8 * 2**20), transposes_pay(0.008, 8 * 2**20)
    (True, False)
    """
    return nbytes >= HOST_TRANSPOSE_RATE * transpose_s


def _say_once(key: str, msg: str, *args) -> None:
    if key not in _SAID:
        _SAID.add(key)
        logger.info(msg, *args)


def host_array(tensor) -> np.ndarray:
    """The tensor's values in host memory (storage dtype, bfloat16 as uint16), with no device memory
    spent: a host array as is, a CPU tensor shared, a device tensor copied out chunk by chunk."""
    return DeviceBoundary(0).host_array(tensor)[0]
