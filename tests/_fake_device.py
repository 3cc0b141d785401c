"""The fake accelerator (``fake_device/``, a Paddle custom-device plugin) for tests.

- ``build(python=None) -> Path``: the folder holding the plugin, built by ``scripts/fake_device.sh``
  for the Paddle of ``python`` (default: this interpreter) or found in its cache. Raises
  ``FakeDeviceError`` (with the compiler's output) if it cannot: tests that need the device then
  fail, they never skip (the ``fake_device`` fixture of ``conftest.py`` calls it).
- ``device_env(base=None, kernels=False, **fakedev) -> dict``: the environment of a process that puts
  tensors on ``fakedev:N``: ``base`` (default ``os.environ``) plus ``CUSTOM_DEVICE_ROOT`` (with
  ``kernels``, the folder that also loads the plugin's ``contiguous`` kernel) and Paddle's
  allocator flags pinned to the defaults the plugin's memory statistics were measured with;
  keyword arguments set the plugin's variables, ``memory_mb=64`` -> ``FAKEDEV_MEMORY_MB=64``
  (``count``, ``memory_mb``, ``comm_timeout_s``, ``comm_buffer_kb``, ``debug``).
  Never put these into ``os.environ`` of the pytest process: every later launch would run on the
  fake device (Paddle's launcher picks a custom device whenever one is loaded).
- ``launch(script, args=(), nranks=2, env=None, **kw) -> harness.LaunchResult``: ``harness.run_launch``
  with ``--devices 0..nranks-1`` and ``device_env(env)``: rank i runs on ``fakedev:i`` with the
  plugin's shared-memory communicator (``init_parallel_env()`` picks the ``xccl`` backend).
- ``library() -> Path``: the ``.so`` itself (for ``ctypes``: ``fakedev_cleanup_stale_segments()``,
  ``fakedev_set_comm_timeout(seconds)``).
- ``contiguous_calls() -> (calls, bytes)``: in a process of ``device_env(kernels=True)``, how often the
  device's ``contiguous`` kernel ran and the bytes it made (None without the kernels).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "fakedev"
LIBRARY = "libfakedev.so"
KERNELS = "libfakedev_kernels.so"

# Paddle's defaults, pinned: with them an allocation of n bytes moves memory_allocated by n rounded
# up to 256 (the plugin's chunk alignment), and memory_reserved by the same (fake_device/README.md)
ALLOCATOR_FLAGS = {"FLAGS_allocator_strategy": "auto_growth", "FLAGS_auto_growth_chunk_size_in_mb": "0",
                   "FLAGS_use_system_allocator": "0"}


class FakeDeviceError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def build(python: str | None = None) -> Path:
    python = python or sys.executable
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "fake_device.sh"), "--python", python],
                          capture_output=True, text=True)
    lines = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    root = Path(lines.get("CUSTOM_DEVICE_ROOT", ""))
    if proc.returncode != 0 or lines.get("DEVICE") != DEVICE or not (root / LIBRARY).is_file() \
            or not (root / "kernels" / KERNELS).is_file():
        raise FakeDeviceError(f"scripts/fake_device.sh failed (rc={proc.returncode}):\n"
                              f"{proc.stdout}\n{proc.stderr[-4000:]}")
    return root


def library(python: str | None = None) -> Path:
    return build(python) / LIBRARY


def device_env(base: dict | None = None, python: str | None = None, kernels: bool = False, **fakedev) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(ALLOCATOR_FLAGS)
    env["CUSTOM_DEVICE_ROOT"] = str(build(python) / "kernels" if kernels else build(python))
    for key, value in fakedev.items():
        env["FAKEDEV_" + key.upper()] = str(value)
    return env


def contiguous_calls():
    """(calls, bytes) of the device's ``contiguous`` kernel in this process so far; None without it."""
    import ctypes

    path = Path(os.environ.get("CUSTOM_DEVICE_ROOT", "")) / KERNELS
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    return (ctypes.c_int64.in_dll(lib, "fakedev_contiguous_calls").value,
            ctypes.c_int64.in_dll(lib, "fakedev_contiguous_bytes").value)


def launch(script, args=(), nranks=2, env=None, python=None, fakedev=None, **kw):
    """``harness.run_launch`` on ``fakedev:0..nranks-1``; ``fakedev``: the plugin's variables as in
    ``device_env``; other keyword arguments go to ``run_launch`` (``log_dir``, ``timeout``)."""
    if str(ROOT / "tests" / "multirank") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests" / "multirank"))
    import harness

    return harness.run_launch(script, args, nproc=nranks, devices=range(nranks), python=python,
                              env=device_env(env, python=python, **(fakedev or {})), **kw)
