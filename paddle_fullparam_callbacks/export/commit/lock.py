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

The directory itself can go away under a running job (removed, replaced, a filesystem mounted
over it) and so can its lock file. Every :data:`CHECK_S` seconds, and at each export, the holder
checks that the directory at the path is the one it locked and that the lock file there is its
own (:meth:`OutputDirLock.verify`). If not, it takes the lock again on the directory now at the
path (making it again if it is gone), so that a second job started into it is refused as before,
and records what happened: the next export fails naming it. If another job holds the lock there
by then, this job stops exporting into the directory (every later export fails naming the other
job): one writer, always.
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
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger("paddle_fullparam_callbacks")

LOCK = ".fullparam.lock"
REFRESH_S = 30.0  # heartbeat period of a live holder
CHECK_S = 5.0  # how often a holder checks that the directory and the lock file are still its own
STALE_S = 300.0  # a lock of another host not refreshed for this long belongs to a dead job


class OutputDirLocked(RuntimeError):
    """Another live job (or another session of this process) exports into the same output_dir."""


_held: Dict[str, "OutputDirLock"] = {}  # resolved output_dir -> the lock this process holds
# reentrant: release() also runs from a garbage collection that starts inside acquire_lock() (the
# weakref finalizer of an earlier session's lock) and from signal handlers, on the thread that may
# hold the guard already; a plain Lock deadlocked there (seen: a test suite hung in acquire_lock)
_held_guard = threading.RLock()


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
        self.dir_id = _identity(self.output_dir)  # the directory this lock is in: (st_dev, st_ino)
        self.events: List[str] = []  # what verify() found and did, until the next export takes them
        self.lost: Optional[str] = None  # set when another job holds the directory: no more exports
        self._verify_guard = threading.Lock()

    def holder_gone(self) -> bool:
        """The owning object no longer exists (collected, cycles included)."""
        if self.holder is None:
            return False
        if self.holder() is not None:
            gc.collect()
        return self.holder() is None

    def _heartbeat(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(CHECK_S):
            self.verify("by the lock's periodic check")
            if self.lost:
                return
            if time.monotonic() - last >= REFRESH_S:
                self.refresh()
                last = time.monotonic()

    def problem(self) -> Optional[str]:
        """None while the directory at the path is the one locked and holds this lock; else what changed."""
        try:
            ident = _identity(self.output_dir)
        except FileNotFoundError:
            return "was removed"
        except OSError as e:
            return f"cannot be examined ({e.strerror or e})"
        if ident != self.dir_id:
            return ("was replaced: another directory is at its path now (removed and made again, or a filesystem "
                    "mounted over it or unmounted)")
        if not self.path.exists():
            return f"lost its lock file {LOCK} (removed by something else than this job)"
        holder = _holder(self.path)
        if holder.get("token") != self.token:
            return f"holds another lock now ({_describe(holder)})"
        return None

    def verify(self, when: str) -> Optional[str]:
        """Check the directory and the lock; if either changed, take the lock again on the directory now
        at the path (or give the directory up to the job that holds it). Returns what happened (also kept
        in :attr:`events`), or None. Called by the heartbeat thread and at each export."""
        with self._verify_guard:
            if self.lost or self._stop.is_set():
                return None
            why = self.problem()
            if why is None:
                return None
            outcome = self._take_again()
            event = f"output_dir {str(self.output_dir)!r} {why} (noticed {when}); {outcome}"
            self.events.append(event)
            logger.warning("%s", event)
            return event

    def _take_again(self) -> str:
        holder = _holder(self.path)
        if holder.get("token") == self.token:  # e.g. the same filesystem mounted again: still ours
            self.dir_id = _identity(self.output_dir)
            return "the directory now at the path holds this job's lock: later exports go there"
        if self.path.exists() or self.path.is_symlink():  # another job's, or unreadable: never removed
            self.lost = (f"output_dir {str(self.output_dir)!r} is locked by another job ({_describe(holder)}); "
                         "this job no longer exports into it")
            return "another job holds its lock: this job stops exporting into it (its later exports fail)"
        try:
            remade = not self.output_dir.is_dir()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            replaced = _identity(self.output_dir) != self.dir_id
            _create_lock_file(self.path, self.token, self.owner)
            self.dir_id = _identity(self.output_dir)
        except FileExistsError:
            self.lost = (f"output_dir {str(self.output_dir)!r} was taken by another job "
                         f"({_describe(_holder(self.path))}); this job no longer exports into it")
            return "another job took its lock first: this job stops exporting into it (its later exports fail)"
        except OSError as e:
            return f"taking its lock again failed ({e.strerror or e}); tried again at the next check"
        if remade:
            return ("this job made it again (empty: the snapshots in it are gone) and holds its lock again: later "
                    "exports go there")
        if replaced:
            return "this job took the lock of the directory now at the path: later exports go there"
        return "this job wrote its lock file again: later exports go there as before"

    def take_events(self) -> List[str]:
        with self._verify_guard:
            events, self.events = self.events, []
        return events

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


def _identity(directory: Path) -> Tuple[int, int]:
    st = os.stat(directory)
    return st.st_dev, st.st_ino


def _create_lock_file(path: Path, token: str, owner: str) -> None:
    """Create the lock file (O_EXCL: FileExistsError if there is one), durable; nothing left on failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": token, "owner": owner,
                       "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)  # a full disk: an empty lock file would block the directory
        raise


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
        host, token = socket.gethostname(), uuid.uuid4().hex
        for _ in range(3):
            try:
                _create_lock_file(path, token, owner)
            except FileExistsError:
                _take_over_if_dead(output_dir, path, host)
                continue
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
