"""The demo's side of the evaluation hook: the interpreter checked before training, each
snapshot's score for the table, and the lines under it (``evaluate_each_snapshot``)."""
from __future__ import annotations

from typing import Optional

from ..config.schema import EVALUATE_METRIC_PREFIX, ConfigError

HF_HINT = ("`make demo ARGS=\"--recipe evaluate_each_snapshot\"` sets PFC_HF_PYTHON to the python of the "
           "checkout's hf environment (scripts/env.sh hf prints it)")


def check(cfg) -> None:
    """Before anything is written: the evaluator's interpreter exists (the recipe's $PFC_HF_PYTHON is set)."""
    if not cfg.evaluate.enabled:
        return
    from ..consumers.evaluate import resolve_python

    try:
        resolve_python(cfg.evaluate)
    except ConfigError as e:
        raise ConfigError(e.key, f"{str(e)[len(e.key) + 2:]}. {HF_HINT}") from e


def trainer_metric(cfg) -> Optional[str]:
    """retention.metric when the trainer's own evaluation gives it (not evaluate.<score>)."""
    metric = cfg.retention.metric
    return None if not metric or metric.startswith(EVALUATE_METRIC_PREFIX) else metric


def score(cb, name: str, metric: str) -> Optional[float]:
    """The evaluation hook's score ``metric`` (evaluate.<key>) of snapshot ``name``, kept or removed since."""
    if not metric.startswith(EVALUATE_METRIC_PREFIX):
        return None
    key = metric[len(EVALUATE_METRIC_PREFIX):]
    found = [ev for ev in cb.evaluation.results if ev.name == name]
    return found[-1].scores.get(key) if found else None


def print_evaluations(cb, logged: list) -> bool:
    """One line per evaluation and the scores logged through trainer.log; False if one failed."""
    results = cb.evaluation.results
    if not cb.config.evaluate.enabled:
        return True
    ok = True
    for ev in sorted(results, key=lambda e: e.step):
        record = ev.record or {}
        if ev.status == "ok":
            scores = ", ".join(f"{k} {v:g}" if k == "tokens" else f"{k} {v:.4f}" for k, v in ev.scores.items()
                               if k in ("perplexity", "nll", "tokens"))
            shown = [(k, v) for k, v in ev.scores.items() if "_stderr" not in k and k != "seconds"]  # lm-eval's
            scores = scores or ", ".join(f"{k} {v:.4g}" for k, v in shown[:4])
            print(f"evaluation of {ev.name}: ok, {scores} ({record.get('seconds', 0):.1f} s; log {ev.name}/"
                  "fullparam_eval.log)")
        else:
            ok = False
            print(f"evaluation of {ev.name}: {ev.status.upper()}: {record.get('error')}")
    if cb.evaluation.waited_s:
        print(f"waited {cb.evaluation.waited_s:.1f} s at the end of training for the evaluations still running "
              f"(evaluate.wait_at_end_s={cb.config.evaluate.wait_at_end_s:g})")
    if not results:
        print("evaluations: none finished")
        ok = False
    if logged:
        metric = cb.config.retention.metric or ""
        tracked = "fullparam/eval/" + metric[len(EVALUATE_METRIC_PREFIX):] if metric.startswith(EVALUATE_METRIC_PREFIX) else None
        keys = sorted({k for entry in logged for k in entry if k != "fullparam/eval/snapshot_step"})
        for key in [tracked] if tracked in keys else keys[:3]:
            values = [f"{e[key]:.4f}@{int(e.get('fullparam/eval/snapshot_step', 0))}" for e in logged if key in e]
            print(f"scores logged through trainer.log as {key} (value@snapshot step): {', '.join(values)}")
    return ok
