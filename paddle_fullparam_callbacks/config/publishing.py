"""The rules of the ``publish:`` section (``schema.PublishConfig``): each finds None or the problem as
``(recipe key, message)``; :func:`check_publish` and :func:`check_against` raise it as the schema's
``ConfigError`` (passed in: this module is below the schema). Pure: nothing here touches the network;
the store itself is proven at the start of training (``consumers/publish/probe.py``).
"""
from __future__ import annotations

import re
from typing import Any, Optional, Tuple

from .rules import check_template, flags_problem, number_problem
from .sizes import parse_size

Problem = Optional[Tuple[str, str]]
PUBLISH_FIELDS = ("snapshot", "name", "step", "output", "python")
MIN_PART, MAX_PART = 5 * 2**20, 5 * 2**30  # S3's part limits (the last part of an upload may be smaller)
# S3's bucket naming rules (3-63 characters; lowercase letters, digits, dots and hyphens; a letter or digit at
# each end); S3-compatible stores accept a subset or the same
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_s3_url(url: Any) -> Tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://bucket/prefix`` (the prefix without slashes at its ends; may be
    empty); ValueError naming what is wrong.

    >>> parse_s3_url("s3://my-bucket/runs/llama/")
    ('my-bucket', 'runs/llama')
    >>> parse_s3_url("s3://My_Bucket/x")
    Traceback (most recent call last):
    ...
    ValueError: 'My_Bucket' is not a valid bucket name (3-63 characters: lowercase letters, digits, dots, hyphens)
    """
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"must be s3://bucket/prefix; got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"{bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, dots, "
                         "hyphens)")
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"the prefix {prefix!r} has an empty, '.' or '..' component; give s3://bucket/a/b")
    if any(ord(c) < 32 or c in "\\{}" for c in prefix):
        raise ValueError(f"the prefix {prefix!r} holds a control character, a backslash or a brace")
    return bucket, prefix


def check_publish(p, error=None) -> Problem:
    """The publish section on its own (``p.url`` is normalised: no trailing slash); with ``error`` (an
    exception class taking (key, message)), a problem is raised as it."""
    problem = _publish_problem(p)
    if problem and error is not None:
        raise error(*problem)
    return problem


def _publish_problem(p) -> Problem:
    if p.url is not None and p.command is not None:
        return "publish.command", "is set together with publish.url: give one of them (a command names its own destination)"
    if p.url is not None:
        try:
            bucket, prefix = parse_s3_url(p.url)
        except ValueError as e:
            return "publish.url", str(e)
        p.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    if p.command is not None:
        problem = check_template("publish.command", p.command, PUBLISH_FIELDS,
                                 "'huggingface-cli upload my-org/my-model {snapshot} {name}'")
        if problem:
            return problem
    ep = p.endpoint_url
    if ep is not None and (not isinstance(ep, str) or not re.fullmatch(r"https?://[^/\s]+/?", ep)):
        return "publish.endpoint_url", f"must be http(s)://host[:port]; got {ep!r}"
    if p.command is not None:
        for key in ("endpoint_url", "region", "keep_last", "keep_best"):
            if getattr(p, key):
                return f"publish.{key}", "applies to publish.url, not to publish.command"
    for key in ("part_size", "max_memory"):
        try:
            parse_size(getattr(p, key))
        except ValueError as e:
            return f"publish.{key}", str(e)
    part = parse_size(p.part_size)
    if not MIN_PART <= part <= MAX_PART:
        return "publish.part_size", f"must be between 5MiB and 5GiB (S3's part limits); got {p.part_size!r}"
    if parse_size(p.max_memory) < 2 * part:
        return "publish.max_memory", (f"{p.max_memory!r} holds fewer than two parts of publish.part_size="
                                      f"{p.part_size!r}: raise it or lower the part size")
    for key, low, integer, strict, high in (("concurrency", 1, True, False, None), ("retries", 0, True, False, None),
                                            ("retry_backoff_s", 0, False, False, None),
                                            ("keep_last", 0, True, False, None), ("keep_best", 0, True, False, None),
                                            ("timeout_s", 0, False, True, None), ("wait_at_end_s", 0, False, False, None),
                                            ("nice", 0, True, False, 19)):
        problem = number_problem(f"publish.{key}", getattr(p, key), low, integer, strict, high)
        if problem:
            return problem
    return flags_problem("publish", p, ("check_etag", "require_conditional_writes"))


def check_against(cfg, error=None) -> Problem:
    """The publish section against the rest of the recipe (raised as ``error`` when given)."""
    problem = _against_problem(cfg)
    if problem and error is not None:
        raise error(*problem)
    return problem


def _against_problem(cfg) -> Problem:
    pub = cfg.publish
    if pub.enabled and cfg.export.format == "callable":
        return ("publish.url" if pub.url else "publish.command"), "export.format=callable writes no snapshot to publish"
    if pub.keep_best and not cfg.retention.metric:
        return "publish.keep_best", "needs retention.metric (e.g. eval_loss) to rank snapshots by"
    return None
