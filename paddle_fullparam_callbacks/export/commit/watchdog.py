"""``export.timeout_s``: a rank that waits too long in one of the package's collectives ends the job.

A stalled rank (a hung GPU, a SIGSTOPped process, a dead NIC) leaves every other rank blocked in
the next collective it takes part in: an export's exchanges and assembly, or the per-event
decision exchange. Paddle's own timeout does not always help (on CPU/gloo the groups keep gloo's
own, and a blocked ``all_gather_object`` was seen waiting beyond 45 s). Like torch's NCCL
watchdog, a thread on every rank watches the collective this rank is in: when it has made no
progress for ``timeout_s``, it logs which step, which collective and which peers have not shown
progress since, releases the output directory's lock, and ends the process with
:data:`EXIT_CODE`, so that ``paddle.distributed.launch`` stops the whole job. Whatever export was
in flight stays a hidden staging directory, removed by the next job.

When a watchdog fires, it first leaves a mark (``ended`` in the progress directory) and gives the other
ranks two of its periods before it ends its process: every rank still waiting in a collective sees the
mark, says what it was waiting for and for whom (the same diagnosis), and ends too. Without it, the
ranks whose own clocks had not run out yet would be stopped by the launcher without a word.

Peers are named from small progress files (``<output_dir>/.fullparam-progress/rank-N``, on the
filesystem every rank shares for the snapshot): each rank's watchdog thread rewrites its own
every second with the collective the rank is in. A peer whose file went stale is not running
(stopped, hung in the kernel, dead); otherwise the peers that have not entered a collective since
this rank started waiting are named, with where each one is.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional, Tuple

logger = logging.getLogger("paddle_fullparam_callbacks")

EXIT_CODE = 75  # EX_TEMPFAIL: the job may be restarted
PROGRESS_DIR = ".fullparam-progress"
ENDED = "ended"  # in PROGRESS_DIR: the first watchdog to fire is ending the job


class Watchdog:
    """One per rank; :meth:`waiting` wraps each collective, :meth:`beat` marks progress inside one."""

    def __init__(self, timeout_s: float, rank: int, world: List[int], progress_dir: Optional[Path] = None,
                 on_expire: Optional[Callable[[], None]] = None, exit_fn: Callable[[int], None] = os._exit):
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.world = list(world)
        self.progress_dir = Path(progress_dir) if progress_dir else None
        self.on_expire = on_expire  # e.g. release the lock (the coordinator)
        self.exit_fn = exit_fn
        self.step: Optional[int] = None
        self.period = max(0.05, min(1.0, self.timeout_s / 10))
        self._last = (None, time.time())  # (collective entered last, when)
        self._active = None  # (what, peers, since_wall, last_progress_monotonic)
        self._guard = threading.Lock()
        self._stop = threading.Event()
        if self.progress_dir is not None:  # an earlier job's mark (none of this job's ranks has waited timeout_s yet)
            try:
                (self.progress_dir / ENDED).unlink()
            except OSError:
                pass
        self._thread = threading.Thread(target=self._run, name="pfc-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching and remove this rank's progress file; the last rank to close removes the
        (then empty) progress directory, so a finished job leaves nothing of it behind."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self.progress_dir is None:
            return
        for name in (f"rank-{self.rank}", f".rank-{self.rank}.tmp"):
            try:
                (self.progress_dir / name).unlink()
            except OSError:
                pass
        try:
            self.progress_dir.rmdir()
        except OSError:
            pass  # other ranks' files are still there (they remove it), or it is gone already

    # ---- what the ranks do -------------------------------------------------------------
    @contextmanager
    def waiting(self, what: str, peers: Optional[List[int]] = None):
        """This rank is in collective ``what`` with ``peers`` (default: every rank)."""
        now = time.time()
        group = list(peers) if peers is not None else self.world
        self._record(what, now)
        with self._guard:
            outer = self._active  # a collective inside a longer phase (an exchange during assembly)
            self._active = (what, group, now, time.monotonic())
        try:
            yield
        except Exception as e:
            self._failed(what, group, now, e)
            raise
        finally:
            with self._guard:
                self._active = None if outer is None else (*outer[:3], time.monotonic())

    def _failed(self, what: str, peers: List[int], since: float, error: Exception) -> None:
        """A collective raised (gloo: 'Connection reset by peer' once a peer's watchdog ended it): the
        same diagnosis as a timeout, so that every rank names the rank that stopped, not only the first
        whose watchdog fired."""
        culprits, where = self.peers_report(peers, since)
        if not culprits:
            return
        first = (str(error).strip().splitlines() or [""])[0][:200]
        message = (f"export.timeout_s={self.timeout_s:g}: rank {self.rank}'s '{what}' (step {self.step}) failed after "
                   f"{time.time() - since:.0f} s ({type(error).__name__}: {first}), waiting for rank(s) {culprits} "
                   f"({where})")
        logger.error(message)
        print(f"paddle_fullparam_callbacks: {message}", file=sys.stderr, flush=True)

    def beat(self) -> None:
        """Progress inside a long collective phase (a tensor arrived): its clock restarts."""
        with self._guard:
            if self._active is not None:
                what, peers, since, _ = self._active
                self._active = (what, peers, since, time.monotonic())

    def _record(self, what: Optional[str] = None, when: Optional[float] = None) -> None:
        """Rewrite this rank's progress file: the collective it entered last, and that it is alive."""
        if what is not None:
            self._last = (what, when)
        if self.progress_dir is None:
            return
        path = self.progress_dir / f"rank-{self.rank}"
        tmp = self.progress_dir / f".rank-{self.rank}.tmp"
        what, entered = self._last
        record = json.dumps({"rank": self.rank, "what": what, "step": self.step, "entered": entered,
                             "alive": time.time(), "pid": os.getpid()})
        for attempt in range(2):
            try:
                tmp.write_text(record)
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                if attempt:
                    return
                try:  # output_dir made again after it was removed (commit.lock): the progress directory too
                    self.progress_dir.mkdir(exist_ok=True)
                except OSError:
                    return  # output_dir itself is gone: never made from here
            except OSError:
                return  # progress files only name the culprit; never a reason to fail

    # ---- the watching thread -----------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._record()  # the heartbeat peers look at
            with self._guard:
                active = self._active
            if active is None:
                continue
            if time.monotonic() - active[3] > self.timeout_s:
                self._expire(*active)
                return
            ended = self._ended_by()
            if ended is not None:
                self._end_with(ended, *active)
                return

    def _ended_by(self) -> Optional[int]:
        """The rank whose watchdog is ending the job (its mark), if another's is."""
        if self.progress_dir is None:
            return None
        try:
            rank = int(json.loads((self.progress_dir / ENDED).read_text())["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return None if rank == self.rank else rank

    def peers_report(self, peers: List[int], since: float) -> Tuple[List[int], str]:
        """(the peers holding this rank up, where every peer is) from their progress files."""
        if self.progress_dir is None:
            return [], ""
        now, gone, behind, where = time.time(), [], [], []
        for r in peers:
            if r == self.rank:
                continue
            try:
                rec = json.loads((self.progress_dir / f"rank-{r}").read_text())
            except (OSError, ValueError):
                rec = {}
            alive, entered = rec.get("alive", 0), rec.get("entered", 0)
            if now - alive > 3 * self.period + 1:
                gone.append(r)
                where.append(f"rank {r} not responding for {now - alive:.0f} s")
            else:
                if entered < since:
                    behind.append(r)
                where.append(f"rank {r} in '{rec.get('what')}' for {now - entered:.0f} s")
        return (gone or behind), "; ".join(where)

    def _waiting_for(self, peers: List[int], since: float) -> str:
        """'waiting for' whom, and where every peer is when the progress files say."""
        culprits, where = self.peers_report(peers, since)
        who = f"rank(s) {culprits}" if culprits else f"one of the ranks {[r for r in peers if r != self.rank]}"
        return f"waiting for {who}{f' ({where})' if where else ''}"

    def _expire(self, what: str, peers: List[int], since: float, _last: float) -> None:
        waiting = self._waiting_for(peers, since)
        message = (f"export.timeout_s={self.timeout_s:g}: rank {self.rank} made no progress for {self.timeout_s:g} s in "
                   f"'{what}' (step {self.step}), {waiting}; ending this process (exit {EXIT_CODE}) so that the launcher "
                   "stops the job; a snapshot in flight stays hidden and is removed by the next job")
        logger.error(message)
        print(f"paddle_fullparam_callbacks: {message}", file=sys.stderr, flush=True)
        if self.progress_dir is not None:
            try:
                tmp = self.progress_dir / f".{ENDED}-{self.rank}.tmp"
                tmp.write_text(json.dumps({"rank": self.rank, "what": what, "step": self.step, "time": time.time()}))
                os.replace(tmp, self.progress_dir / ENDED)
            except OSError:
                pass
        try:
            if self.on_expire is not None:
                self.on_expire()
        finally:
            if self.progress_dir is not None:
                time.sleep(2 * self.period)  # the ranks still waiting see the mark and say why before the launcher acts
            self.exit_fn(EXIT_CODE)

    def _end_with(self, ender: int, what: str, peers: List[int], since: float, _last: float) -> None:
        """Another rank's watchdog is ending the job while this rank waits in ``what``: the same diagnosis,
        then this process ends too."""
        waiting = self._waiting_for(peers, since)
        message = (f"export.timeout_s={self.timeout_s:g}: rank {self.rank}'s '{what}' (step {self.step}) failed after "
                   f"{time.time() - since:.0f} s (rank {ender}'s watchdog is ending the job), {waiting}; ending this "
                   f"process (exit {EXIT_CODE})")
        logger.error(message)
        print(f"paddle_fullparam_callbacks: {message}", file=sys.stderr, flush=True)
        try:
            if self.on_expire is not None:
                self.on_expire()
        finally:
            self.exit_fn(EXIT_CODE)
