"""numpy's BLAS held to one thread while the export's workers multiply (a LoRA merge's product).

OpenBLAS (numpy's wheels bundle it) runs a large product on as many threads as the machine has cores,
and its threads keep spinning for a while after each call, waiting for the next: beside the export's
own workers they take the cores the workers need (measured on 2 cores: a merged LoRA export used 1.5
CPU-seconds instead of 1.1). The workers already run side by side, so each product runs on the thread
that asks for it. This is for speed only: OpenBLAS's thread count (and its kernel, and how a product is
cut into blocks) does change a float32 product's bits (seen on an AMD EPYC, issue 30), so no result of
the package depends on them (``models/lora/product.py`` rounds every LoRA product by one rule). The
library is found among those loaded (like threadpoolctl does); with another BLAS, or none found,
nothing changes.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

_SETTERS = ("openblas_set_num_threads64_", "openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads")
_lock = threading.Lock()
_state = {"users": 0, "before": None}
_api: list = []  # [(set, get)] once found, [None] when there is none


def _find():
    if _api:
        return _api[0]
    found = None
    try:
        with open("/proc/self/maps") as f:  # "address perms offset device inode path"
            paths = sorted({parts[-1] for parts in (line.split() for line in f)
                            if len(parts) >= 6 and "openblas" in parts[-1].lower() and ".so" in parts[-1]})
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(lib, name, None)
            getter = getattr(lib, name.replace("set_", "get_"), None)
            if setter is not None and getter is not None:
                found = (setter, getter)
                break
        if found:
            break
    _api.append(found)
    return found


def threads() -> "int | None":
    """OpenBLAS's thread count now (None without OpenBLAS)."""
    api = _find()
    return int(api[1]()) if api else None


@contextlib.contextmanager
def one_thread():
    """numpy's products on the calling thread only, inside the block (nested and concurrent uses share
    one setting; the last to leave puts the count back)."""
    import numpy  # noqa: F401  (its BLAS is loaded with it)

    api = _find()
    if api is None:
        yield
        return
    with _lock:
        if _state["users"] == 0:
            _state["before"] = int(api[1]())
            if _state["before"] != 1:
                api[0](1)
        _state["users"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0 and _state["before"] not in (None, 1):
                api[0](_state["before"])


__all__ = ["one_thread", "threads"]
