"""One writer per output directory: ``<output_dir>/.fullparam.lock``.

The lock file holds the holder's host, pid and a token; while the job lives a heartbeat thread
refreshes its modification time every :data:`REFRESH_S` seconds. Another job finds the lock and
- fails fast naming the holder, while the holder is alive (same host: its pid exists; another
  host: the lock was refreshed within :data:`STALE_S` seconds);
- takes it over, with a warning, when the holder is gone (same host: no such pid; another host:
  not refreshed for :data:`STALE_S` seconds, e.g. a job preempted on a node that no longer exists).
Two sessions of one process on one directory are refused as well (two callbacks would overwrite
each other's snapshots). On SIGTERM/SIGINT the lock is released before the signal takes its
course (see :func:`release_on_signals`).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Dict, Optional

logger = logging.getLogger("paddle_fullparam_callbacks")

LOCK = ".fullparam.lock"
REFRESH_S = 30.0  # heartbeat period of a live holder
STALE_S = 300.0  # a lock of another host not refreshed for this long belongs to a dead job


class OutputDirLocked(RuntimeError):
    """Another live job (or another session of this process) exports into the same output_dir."""


_held: Dict[str, "OutputDirLock"] = {}  # resolved output_dir -> the lock this process holds
_held_guard = threading.Lock()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputDirLock:
    """The lock of one output directory, held by this process until :meth:`release`."""

    def __init__(self, output_dir: Path, token: str, owner: str):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK
        self.token = token
        self.owner = owner
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.holder = None  # weakref to the owning object, if any

    def holder_gone(self) -> bool:
        """The owning object no longer exists (collected, cycles included)."""
        if self.holder is None:
            return False
        if self.holder() is not None:
            gc.collect()
        return self.holder() is None

    def _heartbeat(self) -> None:
        while not self._stop.wait(REFRESH_S):
            self.refresh()

    def refresh(self) -> None:
        """Tell other hosts this holder is alive (the heartbeat thread calls it every REFRESH_S)."""
        if self._mine():
            try:
                os.utime(self.path)
            except OSError:
                pass

    def _mine(self) -> bool:
        try:
            return json.loads(self.path.read_text()).get("token") == self.token
        except (OSError, ValueError, AttributeError):
            return False

    def start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, name="pfc-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Remove the lock file if it is still this holder's; idempotent, safe in signal handlers."""
        self._stop.set()
        with _held_guard:
            key = str(self.output_dir.resolve())
            if _held.get(key) is self:
                del _held[key]
        if self._mine():
            try:
                self.path.unlink()
            except OSError:
                pass


def _holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since', '?')}"


def acquire_lock(output_dir: Path, owner: str = "an export session", holder=None) -> OutputDirLock:
    """Take the lock of ``output_dir`` for this process, or raise :class:`OutputDirLocked`.

    ``holder``: the object the lock belongs to (an export session); the lock is released when it
    is garbage, so a finished session of this process does not keep the directory.
    """
    output_dir = Path(output_dir)
    key = str(output_dir.resolve())
    other = _held.get(key)
    if other is not None and other.holder_gone():
        other.release()
    with _held_guard:
        other = _held.get(key)
        if other is not None:
            raise OutputDirLocked(
                f"output_dir {str(output_dir)!r} is already used by {other.owner} in this process; two writers "
                "would overwrite each other's snapshots: give each its own output_dir"
            )
        path = output_dir / LOCK
        host, pid, token = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                _take_over_if_dead(output_dir, path, host)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"host": host, "pid": pid, "token": token, "owner": owner,
                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
                f.flush()
                os.fsync(f.fileno())
            lock = OutputDirLock(output_dir, token, owner)
            if holder is not None:
                lock.holder = weakref.ref(holder)
                weakref.finalize(holder, lock.release)
            _held[key] = lock
            lock.start_heartbeat()
            return lock
    raise OutputDirLocked(f"could not take the lock {path}")


def _take_over_if_dead(output_dir: Path, path: Path, host: str) -> None:
    """Remove the lock of a job that is gone; raise if its holder may be alive."""
    holder = _holder(path)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return  # released meanwhile: try again
    same_host = holder.get("host") == host
    pid = holder.get("pid")
    if same_host and isinstance(pid, int) and pid != os.getpid() and not _alive(pid):
        why = f"its process {pid} is gone"
    elif not same_host and age > STALE_S:
        why = f"it was last refreshed {age:.0f} s ago (> {STALE_S:.0f} s)"
    elif not holder and age > STALE_S:
        why = f"it is unreadable and {age:.0f} s old"
    else:
        if not holder:
            raise OutputDirLocked(
                f"output_dir {str(output_dir)!r} has an unreadable lock {path} ({age:.0f} s old); it is taken over "
                f"after {STALE_S:.0f} s, or remove it if no job uses the directory")
        raise OutputDirLocked(
            f"output_dir {str(output_dir)!r} is in use by another job ({_describe(holder)}, refreshed {age:.0f} s ago); "
            f"give this job its own output_dir, or wait: a lock not refreshed for {STALE_S:.0f} s is taken over"
        )
    logger.warning("taking over the lock %s of a dead job (%s): %s", path, _describe(holder), why)
    path.unlink(missing_ok=True)


def release_on_signals(lock: OutputDirLock, signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    """On these signals, release ``lock`` first, then let the signal take its course: the handler
    installed before (the trainer's, Paddle's), or the default action. An export in flight stays a
    hidden staging directory, removed by the next job. Main thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            lock.release()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # SIG_DFL (or None: installed from C): die of the signal, as without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
