"""From what the runner saw to the snapshot's evaluation record (pure, no processes).

The evaluator's result is a JSON object, read from ``{output}`` when the evaluator wrote it, else
from its last line on stdout. Nested objects are flattened with ``/`` (lm-eval's
``{"results": {"hellaswag": {"acc": 0.3}}}`` gives the score ``results/hellaswag/acc``); finite
numbers are its *scores*, logged as ``fullparam/eval/<key>`` and usable as
``retention.metric: evaluate.<key>``. A result with ``"discarded": "<why>"`` is an evaluator saying
its result is not the snapshot's (the bundled lm-eval evaluator's engine moved on): recorded as
``discarded``, without scores. An evaluator that exits non-zero may leave ``{"error": "<why>"}`` in
``{output}``: the record quotes it. Everything read is untrusted: bounded in size, depth and
number of keys, and a result that cannot be read is a failure that says why.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Tuple

from ...export.commit.evaluation import DISCARDED, FAILED, OK, TIMEOUT, UNFINISHED

MAX_RESULT_BYTES = 1_000_000
MAX_DEPTH = 6
MAX_SCORES = 1000


def flatten(obj: dict, prefix: str = "", depth: int = 0, out: Optional[dict] = None) -> dict:
    """Finite numbers of a nested JSON object, keyed by their ``/``-joined path.

    >>> flatten({"perplexity": 12.5, "n": 3, "ok": True, "name": "x", "sub": {"acc": 0.5, "nan": float("nan")}})
    {'perplexity': 12.5, 'n': 3.0, 'sub/acc': 0.5}
    """
    out = {} if out is None else out
    for key, value in obj.items():
        if len(out) >= MAX_SCORES:
            break
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth < MAX_DEPTH:
            flatten(value, f"{name}/", depth + 1, out)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def read_result(output: Optional[Path], last_line: str) -> Tuple[Optional[dict], Optional[str]]:
    """``(result, None)`` or ``(None, why it cannot be read)``: ``output`` if it holds anything,
    else ``last_line``."""
    where, text = "the last line on stdout", last_line or ""
    if output is not None:
        try:
            if output.is_file() and not output.is_symlink() and output.stat().st_size > 0:
                if output.stat().st_size > MAX_RESULT_BYTES:
                    return None, f"{{output}} holds {output.stat().st_size} bytes (at most {MAX_RESULT_BYTES})"
                where, text = "{output}", output.read_text(errors="replace")
        except OSError as e:
            return None, f"{{output}} cannot be read ({e.strerror or e})"
    if not text.strip():
        return None, "no result: nothing written to {output} and nothing printed on stdout"
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        shown = text.strip()[:120]
        return None, f"{where} is not JSON ({str(e)[:80]}): {shown!r}"
    if not isinstance(obj, dict):
        return None, f"{where} is JSON {type(obj).__name__}, not an object: {text.strip()[:120]!r}"
    return obj, None


def final_record(running: dict, status: Optional[dict], output: Optional[Path], log_tail: str = "",
                 stopped_after_s: Optional[float] = None) -> dict:
    """The final record of an evaluation: the running record, updated by the runner's ``status``
    (None: the runner left none, e.g. it was killed with the training job)."""
    record = {k: v for k, v in running.items() if k not in ("status", "evaluation_version")}
    if status is None:
        record.update(status=UNFINISHED, error="the evaluation's process ended without a result (the job that ran "
                                               "it was stopped or killed); `paddle-fullparam evaluate` runs it again")
        return record
    for key in ("exit_code", "seconds", "finished_unix"):
        if status.get(key) is not None:
            record[key] = status[key]
    code, error = status.get("exit_code"), status.get("error")
    if error:
        record.update(status=FAILED, error=str(error))
    elif status.get("terminated"):
        waited = f" (after waiting {stopped_after_s:.0f} s, evaluate.wait_at_end_s)" if stopped_after_s is not None else ""
        record.update(status=UNFINISHED, error=f"stopped: the training ended before it finished{waited}; "
                                               "`paddle-fullparam evaluate` runs it again")
    elif status.get("timed_out"):
        record.update(status=TIMEOUT, error=f"stopped after evaluate.timeout_s={running.get('timeout_s')} s")
    elif code != 0:
        how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit status {code}"
        said, _ = read_result(output, "")
        if said is not None and isinstance(said.get("error"), str) and said["error"].strip():
            how += f": {said['error'].strip()[:2000]}"
        record.update(status=FAILED, error=how)
    else:
        result, why = read_result(output, str(status.get("last_line") or ""))
        if result is None:
            record.update(status=FAILED, error=f"unreadable result: {why}")
        elif isinstance(result.get("discarded"), str):
            record.update(status=DISCARDED, error=f"discarded: {result['discarded'][:2000]}", result=result)
        else:
            scores = flatten(result)
            record.update(status=OK, scores=scores)
            if len(json.dumps(result)) <= 64_000:
                record["result"] = result
    if record["status"] != OK and log_tail:
        record["log_tail"] = log_tail
    return record
