"""Real filesystems for the tests: a tmpfs with ``size=`` and a loop-mounted ext4 image, and the
measurements a test takes of them (free space, this process's descriptors into a directory).

Mounting needs root (CI runs as root on these machines); elsewhere the fixtures skip, saying why.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest


def _run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def _cannot_mount(why: str):
    pytest.skip(f"cannot run: {why} (these tests mount real filesystems; CI runs them as root)")


@contextmanager
def mounted(kind: str, where: Path, size_mb: int = 8):
    """``kind`` "tmpfs" or "ext4" (a loop-mounted image of ``size_mb`` MB, no reserved blocks)."""
    if os.geteuid() != 0:
        _cannot_mount("not root")
    where.mkdir(parents=True, exist_ok=True)
    image = None
    if kind == "tmpfs":
        res = _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where))
    else:
        image = where.parent / f"{where.name}-{uuid.uuid4().hex[:6]}.img"
        with open(image, "wb") as f:
            f.truncate(size_mb << 20)
        res = _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
        if res.returncode == 0:
            res = _run("mount", "-o", "loop", str(image), str(where))
    if res.returncode != 0:
        if image is not None:
            image.unlink(missing_ok=True)
        _cannot_mount(f"mounting {kind} failed: {res.stderr.strip()}")
    try:
        yield where
    finally:
        _run("umount", "-l", str(where))
        if image is not None:
            image.unlink(missing_ok=True)


def remount(where: Path, mode: str) -> None:
    res = _run("mount", "-o", f"remount,{mode}", str(where))
    assert res.returncode == 0, res.stderr


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def descriptors_into(directory: Path) -> list:
    """This process's open descriptors whose target lies in ``directory`` (deleted files included)."""
    found = []
    prefix = str(Path(directory).resolve())
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


def fill(filesystem: Path, leave: int = 0) -> Path:
    """Fill the filesystem with one file, up to the last byte it takes (unbuffered writes until
    ENOSPC), then give back ``leave`` bytes. Returns the file: delete it to get the space back."""
    path = Path(filesystem) / f"filler-{uuid.uuid4().hex[:6]}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 1 << 16, 4096, 512, 1):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError:
                    break
    finally:
        os.close(fd)
    if leave:
        os.truncate(path, max(0, path.stat().st_size - leave))
    return path


def listing(directory: Path) -> list:
    return sorted(os.listdir(directory)) if Path(directory).exists() else []


def clear(directory: Path) -> None:
    for p in Path(directory).iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
