"""What both sides of the bundled lm-eval evaluator share (standard library only): the evaluator's argv and spec,
built in the training job from ``evaluate.lm_eval``, and the naming of its scores, applied in the evaluator.

The spec is one JSON object on the evaluator's command line (so the record's ``command`` shows all of it)::

    {"tasks": [...], "include_path": "/abs/folder", "builtin_tasks": false, "num_fewshot": null, "limit": null,
     "batch_size": 1, "backend": "hf", "log_samples": false, "name": "hf-step-000020",
     "engine": null | {"url": "http://10.0.0.5:8000", "api_key_env": "VLLM_API_KEY", "wait_s": 300.0,
                       "adapter": {"name": "latest", "root": "/models/hf-step-000020/adapter"} (serve.adapter)}}

``name`` is the snapshot's name, which is also the weight version an engine serving it reports (serving names the
weights after the snapshot); with ``serve.adapter``, the engine serves it while the adapter ``adapter.name`` was
loaded from ``adapter.root``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

MODULE = "paddle_fullparam_callbacks.consumers.evaluate.lmeval"
RESULTS = "fullparam_lm_eval.json"
"""The harness's raw results, kept beside the snapshot's evaluation record (``fullparam_evaluation.json``)."""
PREFIX = "lm_eval."
"""Scores are ``lm_eval.<task>.<metric>``: ``retention.metric: evaluate.lm_eval.pfc_choice.acc``."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""Nothing reaches for a hub: tasks, data, model and tokenizer are local files."""


def bundled_tasks() -> Path:
    """The folder of the bundled task pair (``pfc_choice``, ``pfc_generate``), the default ``include_path``."""
    return Path(__file__).resolve().parent / "tasks"


def task_folder(cfg) -> Path:
    return Path(cfg.include_path) if cfg.include_path else bundled_tasks()


def build_spec(cfg, name: str = "", api_key_env: Optional[str] = None, adapter: Optional[dict] = None) -> dict:
    """The evaluator's spec from ``evaluate.lm_eval`` (``cfg``) for the snapshot ``name`` (``adapter``: see
    :func:`build_argv`)."""
    engine = None
    if cfg.backend == "engine":
        engine = {"url": cfg.engine_url, "api_key_env": api_key_env, "wait_s": float(cfg.engine_wait_s)}
        if adapter:
            engine["adapter"] = dict(adapter)
    limit = cfg.limit
    if limit is not None and float(limit) >= 1:
        limit = int(limit)
    return {"tasks": list(cfg.tasks), "include_path": str(task_folder(cfg)), "builtin_tasks": bool(cfg.builtin_tasks),
            "num_fewshot": cfg.num_fewshot, "limit": limit, "batch_size": int(cfg.batch_size), "backend": cfg.backend,
            "log_samples": bool(cfg.log_samples), "name": name, "engine": engine}


def build_argv(cfg, python: List[str], snapshot: Path, output: Path, name: str,
               api_key_env: Optional[str] = None, adapter: Optional[dict] = None) -> List[str]:
    """``python -m <this package> run SNAPSHOT --output OUTPUT --spec JSON``; ``adapter``: ``{"name", "root"}`` when
    the engine serves a LoRA run as adapters (requests name the adapter; it serves this snapshot while its directory
    is ``root``).

    >>> from types import SimpleNamespace as NS
    >>> cfg = NS(tasks=["pfc_choice"], include_path="/t", builtin_tasks=False, num_fewshot=None, limit=8.0,
    ...          batch_size=1, backend="hf", engine_url=None, engine_wait_s=300.0, log_samples=False)
    >>> build_argv(cfg, ["/py"], Path("/s/hf-step-000002"), Path("/s/o.json"), "hf-step-000002")[:6]
    ['/py', '-m', 'paddle_fullparam_callbacks.consumers.evaluate.lmeval', 'run', '/s/hf-step-000002', '--output']
    """
    spec = json.dumps(build_spec(cfg, name, api_key_env, adapter), separators=(",", ":"))
    return [*python, "-m", MODULE, "run", str(snapshot), "--output", str(output), "--spec", spec]


def metric_scores(results: Dict[str, dict]) -> Dict[str, float]:
    """lm-eval's ``results`` (``{task: {"acc,none": 0.3, "acc_stderr,none": 0.1, "alias": ...}}``) as this package's
    scores: ``lm_eval.<task>.<metric>``, the filter dropped where a task has one, kept where it has several; only
    ``metric,filter`` keys with a finite number.

    >>> metric_scores({"mc": {"alias": "mc", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.25},
    ...                "gen": {"exact_match,strict-match": 0.0, "exact_match,flexible": 1.0, "x,none": "N/A"}})
    {'lm_eval.mc.acc': 0.5, 'lm_eval.mc.acc_stderr': 0.25, 'lm_eval.gen.exact_match,strict-match': 0.0, 'lm_eval.gen.exact_match,flexible': 1.0}
    """
    out: Dict[str, float] = {}
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            continue
        keys = {k: v for k, v in metrics.items() if isinstance(k, str) and "," in k and _finite(v)}
        filters = {k.partition(",")[2] for k in metrics if isinstance(k, str) and "," in k}
        for key, value in keys.items():
            metric, _, _ = key.partition(",")
            out[f"{PREFIX}{task}.{metric if len(filters) == 1 else key}"] = float(value)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
