"""Support for the tests that cross the byte path's size thresholds (issue 46, ``tests/unit/test_sizes_*.py``).

Each constant that decides a chunk or a path is shrunk (:func:`shrunk`) so that a tiny tensor crosses it and
chunks do not divide blocks; the result is compared with an independent implementation; scratch and ring memory
are poisoned first (``host/poison.py``), so a byte no loop wrote shows as a difference.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# many small examples: each is a few thousand elements through a pure-numpy path
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                              HealthCheck.data_too_large])


@contextlib.contextmanager
def shrunk(module, **values) -> Iterator[None]:
    """The module's globals set to ``values`` inside the block (hypothesis' examples share one function call, so
    pytest's monkeypatch, which undoes at the test's end, does not fit)."""
    before = {name: getattr(module, name) for name in values}  # an unknown name fails here: no silent typo
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def finite_or_special(rng: np.random.Generator, shape, specials: bool) -> np.ndarray:
    """float32 values of mixed magnitudes; with ``specials``, some zeros, NaNs and infinities, and a zero block."""
    w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 3, size=shape)).astype(np.float32)
    if specials and w.size:
        flat = w.reshape(-1)
        for value in (0.0, -0.0, np.nan, -np.inf, np.inf):
            flat[rng.integers(0, flat.size, size=max(1, flat.size // 200))] = value
        corner = tuple(slice(int(rng.integers(0, n)), None) for n in shape)
        w[corner][tuple(slice(0, 3) for _ in shape)] = 0.0  # a run of zeros (a block whose scale is 1)
    return w


def cut_points(draw, n: int) -> list:
    """Sorted row boundaries 0 = c0 < ... < ck = n, drawn (how a writer splits a tensor's rows)."""
    if n <= 1:
        return [0, n]
    inner = draw(st.lists(st.integers(1, n - 1), max_size=4, unique=True))
    return [0] + sorted(inner) + [n]


__all__ = ["SETTINGS", "cut_points", "finite_or_special", "shrunk"]
