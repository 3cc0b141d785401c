"""The evaluation hook (issue 21): each committed snapshot scored by the user's evaluator in a
separate process while training goes on, its result recorded beside the manifest
(``export/commit/evaluation.py``), logged through the trainer and usable by ``retention.metric``.

``hook.py`` (the coordinator's line of evaluations, on the consumers' hook base ``../hook.py``),
``../runner.py`` (the process between the job and the evaluator, shared with the publisher:
priority, log, timeout, status), ``command.py`` (interpreter and argv), ``result.py`` (from what the
runner saw to the record), ``recovery.py`` (what a killed job left, settled at the next start),
``offline.py`` (``paddle-fullparam evaluate``), and the bundled evaluators, run in the evaluator's
environment: ``perplexity.py`` (transformers only) and ``lmeval/`` (lm-evaluation-harness, ``evaluate.lm_eval``).
"""
from .command import build_argv, resolve_python
from .hook import Evaluation, EvaluationHook
from .lmeval.check import check_lm_eval
from .recovery import recover

__all__ = ["Evaluation", "EvaluationHook", "build_argv", "check_lm_eval", "recover", "resolve_python"]
