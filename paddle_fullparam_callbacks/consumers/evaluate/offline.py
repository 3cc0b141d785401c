"""``paddle-fullparam evaluate SNAPSHOT|OUTPUT_DIR``: the same hook, after training.

In an output directory it takes the directory's lock for its run (one writer at a time), settles
what earlier jobs left (``recovery.py``), evaluates every snapshot that lacks a result (no record,
or one left unfinished; ``--failed`` adds failed, timed-out and discarded ones, ``--all`` every snapshot),
``evaluate.max_concurrent`` at a time, each bounded by ``evaluate.timeout_s``, writing the same
records as during training, and points ``best`` by ``retention.metric``. When a live training job
holds the lock, that job's hook owns the evaluations it runs: only snapshots without a record are
evaluated and ``best`` is left to the job. It never removes anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List

from ...config.schema import ConfigError, FullParamConfig
from ...plan.naming import snapshot_step_pattern
from ...export.commit import evaluation as records
from ...export.commit.lock import OutputDirLocked, acquire_lock
from ...export.commit.ownership import read_manifest
from ...export.commit.retention import list_snapshots, newest_run, update_best
from .command import describe_evaluator, resolve_python
from .hook import Evaluation, EvaluationHook
from .lmeval.check import check_lm_eval
from .recovery import recover

WAIT_FOREVER_S = 10 ** 9  # each evaluation is bounded by evaluate.timeout_s anyway


def targets(path: Path, config: FullParamConfig):
    """((name, step, path, in output dir) of each snapshot, output dir or None) for a snapshot or an output dir."""
    manifest = read_manifest(path)
    if manifest is not None:
        step = manifest.get("step") if isinstance(manifest.get("step"), int) else 0
        return [(path.name, step, path, False)], None
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a snapshot (no fullparam_manifest.json) nor a directory")
    found = [(e.name, e.step, e.path, True) for e in list_snapshots(path, snapshot_step_pattern(config.export.name_template))]
    if not found:
        raise FileNotFoundError(f"{path}: holds no snapshot named like export.name_template "
                                f"({config.export.name_template!r})")
    return found, path


def evaluate_path(path: "str | Path", config: FullParamConfig, redo: str = "missing",
                  say: Callable[[str], None] = print) -> List[Evaluation]:
    """Evaluate the snapshots of ``path`` that need it (``redo``: missing | failed | all); returns
    every evaluation settled or run now. Raises ConfigError without an evaluator."""
    if not config.evaluate.enabled:
        raise ConfigError("evaluate.command", "is not set (nor evaluate.callable, nor evaluate.lm_eval.tasks): give the "
                                              "evaluator with --recipe (e.g. evaluate_each_snapshot) or evaluate.command=...")
    python = resolve_python(config.evaluate)
    if config.evaluate.lm_eval.enabled:
        check_lm_eval(config.evaluate.lm_eval, python)
    snaps, output_dir = targets(Path(path), config)
    lock = None
    if output_dir is not None:
        try:
            lock = acquire_lock(output_dir, owner="paddle-fullparam evaluate")
        except OutputDirLocked as e:
            say(f"{e}: its own hook evaluates what it runs; only snapshots without a record are evaluated here")
            redo = "none"
    try:
        return _evaluate(snaps, output_dir, config, python, redo, lock is not None or output_dir is None, say, lock)
    finally:
        if lock is not None:
            lock.release()


def _evaluate(snaps, output_dir, config, python, redo, settle, say, lock) -> List[Evaluation]:
    settled, alive = recover(snaps) if settle else ([], [])
    for ev in settled:
        say(f"{ev.name}: left by an earlier job, recorded now: {ev.status}")
    busy = {str(ev.path) for ev in alive}
    for ev in alive:
        say(f"{ev.name}: being evaluated by another process (pid {(ev.running or {}).get('pid')}); skipped")
    redo_statuses = {"none": (), "missing": (records.UNFINISHED,),
                     "failed": (records.UNFINISHED, records.FAILED, records.TIMEOUT, records.DISCARDED),
                     "all": records.STATUSES}[redo]
    hook = EvaluationHook(config.evaluate, python, run_id="paddle-fullparam-evaluate",
                          api_key_env=config.serve.api_key_env)
    todo = 0
    for name, step, snap, in_dir in snaps:
        record = records.read_record(snap)
        if str(Path(snap).resolve()) in busy or (record is not None and record.get("status") not in redo_statuses):
            continue
        hook.submit(Evaluation(name, Path(snap).resolve(), step, in_output_dir=in_dir))
        todo += 1
    say(f"evaluating {todo} of {len(snaps)} snapshot(s) with: {describe_evaluator(config.evaluate)}")
    hook.close(WAIT_FOREVER_S)
    done = hook.drain()
    if output_dir is not None and config.retention.metric:
        if lock is None:
            say("best: not updated; the job holding the directory keeps it")
        else:
            ret, pattern = config.retention, snapshot_step_pattern(config.export.name_template)
            best = update_best(output_dir, pattern, ret.metric, ret.mode, newest_run(output_dir, pattern), ret.other_runs)
            say(f"best -> {best} (by {ret.metric}, {ret.mode})" if best else f"best: no snapshot has {ret.metric}")
    return settled + sorted(done, key=lambda ev: ev.step)
