"""The bundled lm-eval evaluator, in the evaluation environment (``evaluate.python``): one snapshot scored by the
harness's Python API, offline, with only the given task folder indexed.

    python -m paddle_fullparam_callbacks.consumers.evaluate.lmeval run SNAPSHOT --output FILE --spec JSON

It runs in the task folder (``data_files`` named relatively are found there), calls ``lm_eval.simple_evaluate``
with ``TaskManager(include_path=<folder>, include_defaults=<builtin_tasks>)`` on transformers (``hf``: the
snapshot's files, float32, CPU) or on the engine that serves the snapshot (``engine``: ``engine.py``), writes the
harness's raw results beside the record (``fullparam_lm_eval.json``, atomically) and its result to ``FILE``::

    {"lm_eval.pfc_choice.acc": 0.625, ..., "seconds": 9.1, "backend": "hf", "results_file": "fullparam_lm_eval.json"}

The outcomes, as the evaluation hook records them: the scores (exit 0); ``{"discarded": why}`` (exit 0: the engine
did not serve the snapshot from the first request to the last: no score is the snapshot's); ``{"error": why}``
(exit 1: the harness failed, or the engine stopped answering).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

from .spec import OFFLINE, RESULTS, metric_scores


def evaluate(snapshot: Path, spec: dict, scratch: Optional[Path] = None) -> dict:
    """The result object for ``snapshot`` (see the module); raises nothing the harness raises: a failure is
    ``{"error": ...}``. ``scratch``: where the raw results are written before they are renamed beside the record
    (the hook's work folder, removed once recorded; default: the snapshot)."""
    os.environ.update(OFFLINE)  # before datasets, transformers and the harness are imported
    t0 = time.perf_counter()
    snapshot = Path(snapshot).resolve()
    _remove(snapshot / RESULTS)  # an earlier evaluation's: this one replaces it, or leaves none
    engine, watch = None, None
    base = {"backend": spec["backend"], "tasks": spec["tasks"]}
    if spec["backend"] == "engine":
        from .engine import Engine, EngineDown, Watch, wait_served

        info = spec["engine"]
        key = os.environ.get(info["api_key_env"] or "", "") or None
        engine = Engine(info["url"], key, adapter=info.get("adapter"), serves=spec["name"])
        base["engine"] = {"url": engine.url, "version": spec["name"]}
        try:
            why = wait_served(engine, spec["name"], snapshot, float(info["wait_s"]))
        except EngineDown as e:
            return {**base, "error": f"the engine does not answer: {e}"}
        if why:
            return {**base, "discarded": why}
        if key:
            os.environ["OPENAI_API_KEY"] = key  # what local-completions sends as its bearer token
        watch = Watch(engine, spec["name"])
    try:
        out = _simple_evaluate(snapshot, spec, engine)
    except Exception as e:  # the harness's failure, or the engine's: told apart by the watch
        why = watch.finish() if watch is not None else None
        if watch is not None and watch.down and not watch.moved:
            return {**base, "error": f"the engine stopped answering during the evaluation ({watch.down}); the "
                                     f"harness said: {type(e).__name__}: {str(e)[:500]}"}
        if why:
            return {**base, "discarded": why}
        return {**base, "error": f"lm-eval failed: {type(e).__name__}: {str(e)[:1000]}"}
    if watch is not None:
        why = watch.finish()
        if why:
            return {**base, "discarded": why}
    scores = metric_scores(out.get("results") or {})
    if not scores:
        return {**base, "error": f"lm-eval gave no metric for {', '.join(spec['tasks'])}: results "
                                 f"{json.dumps(out.get('results'), default=str)[:300]}"}
    _write_results(snapshot / RESULTS, out, scratch or snapshot)
    return {**scores, "seconds": round(time.perf_counter() - t0, 3), **base, "results_file": RESULTS,
            "lm_eval_version": str(out.get("lm_eval_version") or "")}


def _simple_evaluate(snapshot: Path, spec: dict, engine) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = spec["include_path"]
    os.chdir(folder)
    tasks = TaskManager(include_path=folder, include_defaults=bool(spec["builtin_tasks"]))
    if engine is None:
        model, model_args = "hf", {"pretrained": str(snapshot), "dtype": "float32"}
    else:
        from .engine import engine_lm

        model, model_args = engine_lm(engine.url, str(snapshot), spec["batch_size"], engine), None
    return simple_evaluate(model=model, model_args=model_args, tasks=list(spec["tasks"]), task_manager=tasks,
                           num_fewshot=spec["num_fewshot"], limit=spec["limit"], batch_size=spec["batch_size"],
                           device="cpu", log_samples=bool(spec["log_samples"]))


def _write_results(path: Path, out: dict, scratch: Path) -> None:
    """The harness's results object, as its own CLI writes it (what JSON cannot hold, as text), atomically."""
    if scratch.stat().st_dev != path.parent.stat().st_dev:  # a rename cannot cross filesystems
        scratch = path.parent
    tmp = scratch / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def main(snapshot: str, output: Optional[str], spec_text: str) -> int:
    result = evaluate(Path(snapshot), json.loads(spec_text), Path(output).resolve().parent if output else None)
    text = json.dumps(result)
    if output:
        Path(output).write_text(text + "\n")
    print(text, flush=True)
    if "error" in result:
        print(f"lm-eval evaluator: {result['error']}", file=sys.stderr, flush=True)
        return 1
    return 0
