"""The commands of the consumers of snapshots, after the fact: ``evaluate``, ``publish`` and ``serve`` run the
evaluation hook, the publisher and the serving engines' swaps on snapshots already on disk, with the engines,
records and logs a training job uses."""
from __future__ import annotations

import sys


def _cmd_evaluate(ns) -> int:
    """Exit 0 if every evaluation run or settled now is ok, 1 otherwise, 2 for usage or recipe errors."""
    import logging

    from ..config.recipes import load_config
    from ..consumers.evaluate.offline import evaluate_path

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(ns.recipe, ns.overrides)
    redo = "all" if ns.all else "failed" if ns.failed else "missing"
    try:
        done = evaluate_path(ns.path, config, redo=redo)
    except FileNotFoundError as e:
        print(f"paddle-fullparam evaluate: {e}", file=sys.stderr)
        return 2
    for ev in done:
        record = ev.record or {}
        if ev.status == "ok":
            what = ", ".join(f"{k}={v:.6g}" for k, v in list(ev.scores.items())[:8]) or "no numeric score"
        else:
            what = str(record.get("error"))
        print(f"{ev.name:<20} step {ev.step:>7}  {ev.status:<10} {what}")
    return 0 if all(ev.status == "ok" for ev in done) else 1


def _cmd_publish(ns) -> int:
    """Exit 0 if every publication run or settled now is ok, 1 otherwise, 2 for usage, recipe or store errors."""
    import logging

    from ..config.recipes import load_config
    from ..export.commit.lock import OutputDirLocked
    from ..consumers.publish.offline import publish_path
    from ..consumers.publish.probe import ProbeFailed

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_config(ns.recipe, list(ns.overrides or []) + ([f"publish.url={ns.to}"] if ns.to else []))
    try:
        done = publish_path(ns.output_dir, config, redo_all=ns.all)
    except (FileNotFoundError, OutputDirLocked, ProbeFailed) as e:
        print(f"paddle-fullparam publish: {e}", file=sys.stderr)
        return 2
    for pub in done:
        entry = pub.entry or {}
        result = entry.get("result") or {}
        what = (f"{result.get('url', '')} {result.get('bytes', 0) / 1e6:.1f} MB" if pub.status == "ok"
                else str(entry.get("error")))
        print(f"{pub.name:<20} step {pub.step:>7}  {pub.status:<10} {what}")
    return 0 if all(p.status == "ok" for p in done) else 1


def _cmd_serve(ns) -> int:
    """Exit 0 if every engine serves the snapshot, 1 if one did not take it, 2 for usage, recipe or engine errors."""
    import logging

    from ..config.recipes import load_config
    from ..config.schema import ConfigError
    from ..export.commit.lock import OutputDirLocked
    from ..consumers.serve.offline import serve_path
    from ..consumers.serve.probe import ServeStartFailed

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    urls = f"serve.url=[{','.join(ns.to)}]" if ns.to else None
    try:
        config = load_config(ns.recipe, list(ns.overrides or []) + ([urls] if urls else []))
        job = serve_path(ns.path, config)
    except (ConfigError, FileNotFoundError, OutputDirLocked, ServeStartFailed) as e:
        print(f"paddle-fullparam serve: {e}", file=sys.stderr)
        return 2
    entries = job.entries or {url: job.record or {} for url in config.serve.urls}
    for url, entry in entries.items():
        what = (f"reload {entry.get('reload_s', 0):.2f} s, {entry.get('served_s', 0):.2f} s in all" if entry.get("status") == "ok"
                else f"{entry.get('error')}; serving {entry.get('version') or 'what it served before'}")
        print(f"{url:<32} {job.name:<20} {entry.get('status', '?'):<8} {what}")
    return 0 if entries and all(e.get("status") == "ok" for e in entries.values()) else 1


def add_consumer_commands(sub, overrides_help: str) -> None:
    text = ("run the evaluation hook (evaluate.command or evaluate.callable of a recipe) on a snapshot, or on the "
            "snapshots of an output directory that lack a result")
    e = sub.add_parser("evaluate", help=text, description=text + "; exit 0 if all are ok, 1 if any failed, 2 for usage.")
    e.add_argument("path", metavar="SNAPSHOT|OUTPUT_DIR", help="a snapshot directory or an output directory")
    e.add_argument("--recipe", help="a bundled recipe name or YAML path with an evaluate section (e.g. "
                                    "evaluate_each_snapshot)")
    e.add_argument("--failed", action="store_true", help="also run again the evaluations that failed, timed out or were discarded")
    e.add_argument("--all", action="store_true", help="evaluate every snapshot again")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help + "; e.g. evaluate.python=$PFC_HF_PYTHON")
    e.set_defaults(func=_cmd_evaluate)

    text = ("publish the snapshots of an output directory that are not published yet (or whose publication an "
            "earlier job left unfinished) to object storage, with the engine the training job uses")
    pu = sub.add_parser("publish", help=text, description=text + "; exit 0 if all are ok, 1 if any failed, 2 for usage "
                                                                 "or when the store cannot be used.")
    pu.add_argument("output_dir", metavar="OUTPUT_DIR", help="an output directory of snapshots")
    pu.add_argument("--to", metavar="s3://BUCKET/PREFIX", help="the destination (publish.url); credentials and endpoint "
                                                               "from the AWS chain (AWS_* variables, ~/.aws)")
    pu.add_argument("--recipe", help="a bundled recipe name or YAML path with a publish section")
    pu.add_argument("--all", action="store_true", help="publish every snapshot again, published ones included")
    pu.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help + "; e.g. publish.endpoint_url=...")
    pu.set_defaults(func=_cmd_publish)

    text = ("switch running serving engines (vLLM with VLLM_SERVER_DEV_MODE=1) to a snapshot already on disk, in "
            "place, requests kept, as a training job with a serve section does")
    se = sub.add_parser("serve", help=text, description=text + "; exit 0 if every engine serves it, 1 if one did not "
                                                               "take it, 2 for usage or when an engine cannot be used.")
    se.add_argument("path", metavar="SNAPSHOT|OUTPUT_DIR", help="a snapshot, or an output directory (its latest snapshot)")
    se.add_argument("--to", metavar="http://HOST:PORT", action="append",
                    help="an engine's base URL (serve.url); repeat it for every replica")
    se.add_argument("--recipe", help="a bundled recipe name or YAML path with a serve section")
    se.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help + "; e.g. serve.api_key_env=VLLM_API_KEY")
    se.set_defaults(func=_cmd_serve)
