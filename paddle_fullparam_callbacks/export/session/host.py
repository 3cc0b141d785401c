"""Host memory of an export: tensors as the host arrays the writer needs (copying as little as possible),
private copies for background writes, and the reusable ring they go into."""
from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import numpy as np

from ...assemble.device import host_array
from ...host.casts import memory_order as _memory_order
from ...host.lazy import LazyArray
from ...host.poison import fresh


def to_host_array(tensor):
    """A numpy array of the tensor's bytes (bfloat16 as uint16 bits): a host array as it is, a CPU
    tensor shared (DLPack, strides included: a transposed view stays a view, and the writer copies
    it block by block), a device tensor copied out through the device boundary; a lazy array (a cast,
    a LoRA merge) as it is: the writer computes it block by block on its worker threads."""
    if isinstance(tensor, LazyArray):
        return tensor
    return host_array(tensor)


def plain_array(tensor) -> np.ndarray:
    """:func:`to_host_array`, a lazy array computed (on the worker threads)."""
    arr = to_host_array(tensor)
    return arr.materialize() if isinstance(arr, LazyArray) else arr


def detached_copy(array) -> np.ndarray:
    """A private copy of ``array``'s values, made as cheaply as possible (a lazy array: computed).

    A transposed view is copied in its memory order (a plain memcpy) and handed back as the same
    transposed view of the copy; the writer turns it into file order later, on its own thread.
    Copying it directly in logical order is a strided copy, several times slower.

    >>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
    >>> y = detached_copy(x.T)
    >>> bool(np.array_equal(y, x.T)) and not np.shares_memory(y, x)
    True
    """
    if isinstance(array, LazyArray):
        return array.materialize()
    if array.flags.c_contiguous or array.ndim < 2:
        return np.array(array, copy=True, order="C")
    order, inverse = _memory_order(array)
    in_memory_order = array.transpose(order)
    if not in_memory_order.flags.c_contiguous:
        return np.array(array, copy=True, order="C")
    return np.array(in_memory_order, copy=True, order="C").transpose(inverse)


class HostRing:
    """Reusable host memory for background writes: ``size`` bytes, touched once, used as a ring.

    Copying a snapshot into freshly allocated memory pays a page fault per 4 KB (most of the
    training stall of an async export, measured); a ring that lives as long as the job pays it
    once. ``alloc`` blocks while the writer still holds the bytes it needs (back pressure), but only
    while waiting can end: room comes back in allocation order, so only once the oldest allocation
    still held is freed, and a tensor the writer keeps for later (out of file order, waiting for one
    not handed over yet: maybe the one being allocated) is freed by nothing but more allocations. The
    caller says which allocations the writer will free without more (``may_wait``); when the oldest is
    not one of them, ``alloc`` returns None at once and the caller makes an ordinary copy (issue 42: a
    ring about one tensor's size held an export 30 s). ``wait_s`` stays a last resort; ``timeouts``
    counts the waits it ended.
    """

    def __init__(self, size: int, wait_s: float = 30.0):
        import collections
        import threading

        self.size = int(size)
        self.buf = np.empty(self.size, dtype=np.uint8)
        self.buf.fill(0)  # fault every page in now, at setup, not during an export
        self.wait_s = wait_s
        self._cv = threading.Condition()
        self._live = collections.deque()  # [start, end, done, key] in allocation order
        self._head = self._tail = 0  # byte counters, monotonic
        self.timeouts = 0  # waits ended by wait_s without room (never, unless a may_wait promise failed)

    def reset(self) -> None:
        """Forget every allocation (call only when no writer uses the ring)."""
        with self._cv:
            self._live.clear()
            self._head = self._tail = 0

    def alloc(self, n: int, wait: bool = True, key=None, may_wait=None):
        """(a uint8 view of n bytes, a token for free()) or (None, None). ``wait``: while the writer frees
        room (back pressure), and only while ``may_wait(oldest)`` says that the oldest allocation still held
        (its ``key``, given when it was made: ``token[3]``) will be freed without more allocations (without
        ``may_wait``: up to ``wait_s``); otherwise only room there is now."""
        if n <= 0 or n > self.size:
            return None, None
        with self._cv:
            if self._head == self._tail:  # empty: start at the buffer's beginning (no wasted tail before a large one)
                self._head = self._tail = -(-self._head // self.size) * self.size

            def room():
                pos = self._head % self.size
                waste = self.size - pos if pos + n > self.size else 0
                return self._head + waste + n - self._tail <= self.size, waste

            ok, waste = room()
            while not ok and wait and self._live:
                oldest = self._live[0]  # never a freed one: free() drops those from the front
                if may_wait is not None and not may_wait(oldest):
                    break  # nothing will free it: no wait at all
                if not self._cv.wait_for(lambda: room()[0] or oldest[2], timeout=self.wait_s):
                    self.timeouts += 1
                    break
                ok, waste = room()
            if not ok:
                return None, None
            start = self._head + waste
            self._head = start + n
            token = [start, self._head, False, key]
            self._live.append(token)
        p = start % self.size
        return fresh(self.buf[p:p + n]), token

    def free(self, token) -> None:
        with self._cv:
            token[2] = True
            while self._live and self._live[0][2]:
                self._tail = self._live.popleft()[1]
            self._cv.notify_all()

    def array(self, shape: Sequence[int], dtype) -> Optional[np.ndarray]:
        """A new C-contiguous array of ``shape`` and ``dtype`` in the ring, or None where there is no room
        now (never waits: the caller, the device boundary, then makes an ordinary array). The ring gets
        its bytes back when the last array made from it (views, transposes, a lazy cast of it) is gone,
        so it can go to the writer as it is: nothing copies it again (:meth:`holds`)."""
        dtype = np.dtype(dtype)
        view, token = self.alloc(math.prod(shape) * dtype.itemsize, wait=False)
        if view is None:
            return None
        owner = _Block(view.view(dtype).reshape(tuple(shape)), token)
        weakref.finalize(owner, self.free, token)
        return np.asarray(owner)

    @staticmethod
    def _block(array) -> "Optional[_Block]":
        base = array
        while isinstance(base, np.ndarray):
            base = base.base
        return base if isinstance(base, _Block) else None

    @staticmethod
    def holds(array) -> bool:
        """Whether ``array`` (or the array it views) was made by :meth:`array`."""
        return HostRing._block(array) is not None

    def label(self, array, key) -> None:
        """Name the allocation an array of :meth:`array` lives in (what ``may_wait`` is asked about)."""
        block = self._block(array)
        if block is not None:
            with self._cv:
                block.token[3] = key

    def copy_in(self, array, key=None, may_wait=None):
        """(a copy of ``array`` in the ring, release callback) or (None, None) if it does not fit (see
        :meth:`alloc` for ``key`` and ``may_wait``).

        Copied in memory order (a memcpy, see detached_copy) and returned with the same strides; a lazy
        array is computed into the ring (on the worker threads)."""
        view, token = self.alloc(array.nbytes, key=key, may_wait=may_wait)
        if view is None:
            return None, None
        if isinstance(array, LazyArray):
            return array.materialize(view.view(array.dtype).reshape(array.shape)), (lambda: self.free(token))
        order, inverse = _memory_order(array)
        src = array.transpose(order)
        dest = view.view(array.dtype).reshape(src.shape)
        np.copyto(dest, src)
        return dest.transpose(inverse), (lambda: self.free(token))


class _Block:
    """The owner of one ring allocation given out as an array. numpy stops a view's chain of bases at the
    first object that is not an array, so every array made from the block keeps this object alive, and
    its finalizer returns the bytes when the last one goes (a plain view of the ring would not: its base
    would be the whole ring buffer)."""

    __slots__ = ("__array_interface__", "_values", "token", "__weakref__")

    def __init__(self, values: np.ndarray, token):
        self._values = values  # keeps the ring's buffer alive as long as the block
        self.token = token
        self.__array_interface__ = values.__array_interface__


def with_zero_row(tensor, row: int) -> np.ndarray:
    """A host copy of ``tensor`` with ``row`` set to zeros (an embedding's padding row: Paddle's
    ``padding_idx`` returns zeros for that id, torch returns the stored row). Never writes into
    the model's own memory."""
    arr = to_host_array(tensor)
    arr = arr.materialize() if isinstance(arr, LazyArray) else np.array(arr, copy=True)
    arr[row] = 0
    return arr
