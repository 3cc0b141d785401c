"""The host staging ring used by background writes."""
from __future__ import annotations

import threading

import numpy as np

from paddle_fullparam_callbacks.export.session.host import HostRing, detached_copy


def test_copy_in_keeps_values_and_strides():
    ring = HostRing(1024)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    for src in (x, x.T, x[:, 1:3].T.copy()):
        out, release = ring.copy_in(src)
        assert np.array_equal(out, src) and not np.shares_memory(out, src)
        assert np.shares_memory(out, ring.buf)
        release()


def test_ring_wraps_and_blocks_until_freed():
    ring = HostRing(100, wait_s=5)
    a, ta = ring.alloc(60)
    b, tb = ring.alloc(40)
    assert a is not None and b is not None
    got = {}

    def late():
        got["view"] = ring.alloc(50)[0]

    t = threading.Thread(target=late)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # no room: back pressure
    ring.free(tb)  # freed out of order: the head (a) still holds the ring
    t.join(0.2)
    assert t.is_alive()
    ring.free(ta)
    t.join(5)
    assert got["view"] is not None and got["view"].nbytes == 50


def test_ring_gives_up_instead_of_deadlocking():
    ring = HostRing(64, wait_s=0.05)
    held, _ = ring.alloc(64)
    assert held is not None
    assert ring.alloc(8) == (None, None)  # caller falls back to an ordinary copy
    assert ring.alloc(65) == (None, None)  # larger than the ring


def test_detached_copy_of_transposed_view_is_private():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = detached_copy(x.T)
    x[0, 0] = 99
    assert y[0, 0] == 0 and y.shape == (4, 3)


def test_ring_arrays_return_their_bytes_when_the_last_view_goes():
    """The device boundary's arrays in the ring (a background export): held by any view made from them (a
    transpose, a slice, a lazy cast's source), the bytes come back when the last one goes, never earlier,
    and a full ring says so at once instead of waiting (the caller makes an ordinary array)."""
    ring = HostRing(1000, wait_s=5)
    a = ring.array((10, 5), np.float32)  # 200 bytes
    a[...] = np.arange(50, dtype=np.float32).reshape(10, 5)
    view = a.T[1:]
    assert HostRing.holds(a) and HostRing.holds(view) and not HostRing.holds(np.zeros(3))
    assert a.flags.c_contiguous and a.flags.writeable
    del a
    b = ring.array((200,), np.float32)  # 800 bytes: the first 200 are still held by `view`
    assert b is not None and not np.shares_memory(b, view)
    assert ring.array((1,), np.float64) is None  # full: no wait
    assert np.array_equal(view, np.arange(50, dtype=np.float32).reshape(10, 5).T[1:])  # untouched
    del view
    c = ring.array((25,), np.float64)  # the 200 bytes are back (before b's region, in ring order)
    assert c is not None
    del b, c
    assert ring.array((250,), np.float32) is not None  # everything back
