"""The hook's end of the swap agent (``agent.py``): the process started, handed one work folder at a time, its
answer awaited within a bound; and the work folder a swap uses."""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ...export.commit.ownership import delete_marked, is_marked, mark
from ..runner import cmdline
from . import records
from .agent import OUTPUT

AGENT = Path(__file__).resolve().with_name("agent.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding paddle_fullparam_callbacks/


class Agent:
    """The hook's swap agent (``agent.py``): started with the hook in a session of its own (it imports the
    package's verification meanwhile), told one work folder at a time, answering when that swap has ended;
    started again after it died or stopped answering."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self._ready = False

    def start(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-I", str(AGENT), PACKAGE_ROOT], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, start_new_session=True)
            self._ready = False
        return self.proc.pid

    def run(self, work: Path, timeout_s: float) -> Optional[str]:
        """Hand ``work`` to the agent; None once it answered, else why not (it died, or gave no answer within
        ``timeout_s``: then it is killed, and the next swap starts another)."""
        proc = self.proc
        deadline = time.monotonic() + timeout_s
        if not self._ready:  # its first line: the package imported (one start's cost, before any swap)
            why = self._line(deadline, timeout_s)
            if why:
                return why
            self._ready = True
        try:
            proc.stdin.write(f"{work}\n".encode())
            proc.stdin.flush()
        except OSError as e:
            return self._lost(f"the swap agent could not be reached ({e})")
        return self._line(deadline, timeout_s)

    def _line(self, deadline: float, timeout_s: float) -> Optional[str]:
        """Read one answer line; None, or why there is none."""
        answer, fd = b"", self.proc.stdout.fileno()
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return self._lost(f"the swap agent gave no answer within {timeout_s:.0f} s", kill=True)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1)  # one byte at a time: never past this answer's line
                if not chunk:
                    return self._lost(f"the swap agent ended (exit status {self.proc.wait()})")
                answer += chunk
        return None

    def _lost(self, why: str, kill: bool = False) -> str:
        if kill and self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        return why

    def close(self) -> None:
        """No more swaps: the agent sees its input closed and exits."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self.proc = None


def agent_works(running: dict, work: Path) -> bool:
    """Whether the swap agent of a running record still works on ``work`` (on this host: ``/proc``)."""
    if running.get("host") not in (None, socket.gethostname()):
        return False
    args = cmdline(running.get("pid"))
    return any(arg.endswith(AGENT.name.encode()) for arg in args) and not (work / OUTPUT).exists()


def prepare_work(snapshot: Path, run_id: str) -> Path:
    """The snapshot's marked work folder for its swap (an earlier attempt's files removed)."""
    work = snapshot / records.WORKDIR
    if work.exists() or work.is_symlink():
        if not (work.is_dir() and not work.is_symlink() and is_marked(work)):
            raise FileExistsError(f"{work} exists and is not this package's; left alone")
        delete_marked(work)
    work.mkdir()
    mark(work, run_id)
    return work
