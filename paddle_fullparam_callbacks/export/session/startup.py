"""What a session claims and proves at start, before its first export (``ExportSession.start``).

- :meth:`Claim.take`, the coordinator's claim on output_dir: the directory and its pointers
  checked, its lock taken (released on signals and at exit), leftovers of interrupted exports
  removed (provably this package's: the lock says no other job writes here), this job's run
  settled, and a visibility token written into each directory every rank must see;
- :func:`prove_shared`, with several ranks: every rank reads the coordinator's tokens and makes a
  file beside them (``commit.visibility``); one exchange;
- :func:`watchdog`, with several ranks and ``export.timeout_s``: every collective watched;
- :func:`remove_unused`, at close: an output_dir the claim created and nothing used goes again.

The session decides the order (the claim's outcome in one exchange, then the proof, then the
watchdog: every rank enters the same collectives in the same order) and acts on what these return.
"""
from __future__ import annotations

import atexit
import builtins
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .. import commit
from ..commit import visibility
from ..commit.lock import OutputDirLock, release_on_signals
from ..commit.retention import newest_run, next_seq
from ..commit.watchdog import PROGRESS_DIR, Watchdog
from .finishing import new_run_id

Target = Tuple[str, Path]  # (recipe key, a directory every rank must see as the coordinator does)


@dataclass
class Claim:
    """The coordinator's hold on output_dir, as far as :meth:`take` got; the other ranks keep the default."""

    run: Tuple[str, int] = field(default_factory=lambda: (new_run_id(), 1))  # (run id, its next sequence number)
    created: bool = False  # output_dir did not exist before
    lock: Optional[OutputDirLock] = None
    removed: List[str] = field(default_factory=list)  # leftovers of interrupted exports
    tokens: List[str] = field(default_factory=list)  # one per target, in order
    error: Optional[Tuple[str, str]] = None  # (exception type name, message) of what stopped the claim

    @property
    def shared(self) -> tuple:
        """What every rank contributes to the start's exchange."""
        return self.error, self.run, self.tokens

    def take(self, output_dir: Path, pattern, resume: bool, targets: Sequence[Target], holder) -> None:
        """Claim ``output_dir`` (``targets[0]``; the rest are made if missing). Whatever stops the claim (an
        OSError, OutputDirLocked, or any other exception) is kept in ``error``, never raised here: every rank
        waits in the start's exchange for the coordinator's outcome, so an exception raised past it would leave
        them waiting. A lock already taken stays in ``lock``.

        ``resume``: continue the run of the newest snapshot here; ``holder``: the lock's owner (released
        when it is garbage)."""
        try:
            self.created = not output_dir.exists()
            commit.check_output_dir(output_dir)
            commit.check_pointers(output_dir)
            # one job per output_dir: only then are leftovers surely ours to remove
            self.lock = commit.acquire_lock(output_dir, owner="another export session", holder=holder)
            release_on_signals(self.lock)
            atexit.register(self.lock.release)
            self.removed, _ = commit.cleanup_stale(output_dir)
            run_id = (newest_run(output_dir, pattern) if resume else None) or self.run[0]
            self.run = (run_id, next_seq(output_dir, pattern, run_id))
            for _, directory in targets[1:]:
                Path(directory).mkdir(parents=True, exist_ok=True)
            self.tokens = [visibility.write_token(d) for _, d in targets]
        except Exception as e:  # noqa: BLE001 -- raised by the session after the exchange, on every rank
            self.error = (type(e).__name__, str(e))


def claim_error(kind: str, message: str) -> Exception:
    """The exception every rank raises for a failed claim (``Claim.error``): OutputDirLocked, an OSError for
    any of its kinds, and for anything else (a defect) a RuntimeError that names what the coordinator met."""
    if kind == "OutputDirLocked":
        return commit.OutputDirLocked(message)
    if isinstance(getattr(builtins, kind, None), type) and issubclass(getattr(builtins, kind), OSError):
        return OSError(message)
    return RuntimeError(f"the coordinator's claim on output_dir failed with {kind}: {message}")


def remove_tokens(ctx, targets: Sequence[Target], tokens: Sequence[str]) -> None:
    """The coordinator removes its token files (the other ranks: nothing)."""
    if ctx.is_coordinator:
        for (_, directory), token in zip(targets, tokens):
            visibility.remove_token(directory, token)


def prove_shared(ctx, targets: Sequence[Target], tokens: Sequence[str], timings: dict) -> Optional[Tuple[str, str]]:
    """Every rank reads the coordinator's token in each target and makes a file there; one exchange
    (none without targets). Returns (recipe key, message) of the first target some rank cannot use,
    the same on every rank, or None. ``timings`` gets the seconds of the files and of the exchange."""
    if not targets:
        return None
    t0 = time.perf_counter()
    mine = [visibility.probe(d, t, ctx.rank) for (_, d), t in zip(targets, tokens)]
    t1 = time.perf_counter()
    results = ctx.all_gather_object(mine, what="visibility proof")
    remove_tokens(ctx, targets, tokens)
    timings.update(visibility_files_s=t1 - t0, visibility_exchange_s=time.perf_counter() - t1)
    for i, (key, directory) in enumerate(targets):
        what = "" if key == "output_dir" else "the trainer's output_dir (where the checkpoint hook commits) "
        message = visibility.unshared_message(Path(directory), [r[i] for r in results], what)
        if message:
            return key, message
    return None


def watchdog(timeout_s: Optional[float], ctx, output_dir: Path, lock: Optional[OutputDirLock]) -> Optional[Watchdog]:
    """export.timeout_s, with several ranks: every collective of the package is watched (None otherwise).
    Its progress files go to ``output_dir``; on expiry it releases ``lock`` (the coordinator's)."""
    if ctx.world_size <= 1 or not timeout_s:
        return None
    progress = output_dir / PROGRESS_DIR
    try:
        progress.mkdir(exist_ok=True)
    except OSError:
        progress = None  # the culprit will not be named; the timeout still holds
    return Watchdog(timeout_s, ctx.rank, list(range(ctx.world_size)), progress,
                    on_expire=lock.release if lock is not None else None)


def remove_unused(output_dir: Path) -> None:
    """An output_dir the claim created and nothing exported into (e.g. the checkpoint hook wrote every
    snapshot into the trainer's checkpoints) is removed again, with the package's own entries."""
    try:
        entries = {p.name for p in output_dir.iterdir()}
        if entries - {PROGRESS_DIR}:
            return
        if PROGRESS_DIR in entries:
            shutil.rmtree(output_dir / PROGRESS_DIR, ignore_errors=True)
        output_dir.rmdir()
    except OSError:
        pass  # another process wrote into it meanwhile: it stays
