"""``paddle-fullparam``: demo | verify | convert | evaluate | publish | serve | plan | selfcheck | recipes | run."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from .consumers import add_consumer_commands

DESCRIPTION = (
    "Full-parameter Hugging Face snapshots of PaddlePaddle training jobs. "
    "demo: train a tiny model on CPU with the callback and list its snapshots; verify: check snapshots; "
    "convert: an HF snapshot from a trainer checkpoint on disk; evaluate: run the evaluation hook on snapshots; "
    "publish: copy snapshots to object storage (s3://); serve: switch running serving engines (vLLM) to a snapshot; "
    "plan: show how a hybrid-parallel job would assemble and write a snapshot; recipes: list the bundled recipes; "
    "run: run a training command (paddleformers-cli train, a launcher, a script) with snapshots switched on, no code."
)
OVERRIDES_HELP = ("recipe overrides as key=value, e.g. trigger.every_n_steps=10 retention.keep_last=2; a value that "
                  "starts with { is taken as text for text keys (export.name_template={step:06d})")


def _count(minimum: int):
    """An argparse type: a whole number >= minimum, with an error that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}; got {value}")
        return value
    parse.__name__ = f"whole number >= {minimum}"
    return parse


def _cmd_verify(ns) -> int:
    """Exit 0 if everything verifies, 1 if anything is damaged (or verify itself failed), 2 for a
    usage error. With --json, exactly one JSON object on stdout, whatever happens."""
    from ..export.verify import render

    def emit(obj: dict, lines) -> None:
        if ns.json:
            print(json.dumps(obj))
            return
        enc = getattr(sys.stdout, "encoding", None) or "utf-8"
        for line in lines:  # names read from disk may not be encodable: escape, never crash
            print(line.encode(enc, "backslashreplace").decode(enc, "replace"))

    if not ns.dirs:
        msg = "give at least one DIR: a snapshot, an output directory or a latest/best pointer file"
        print(f"paddle-fullparam verify: {msg}", file=sys.stderr)
        if ns.json:
            print(json.dumps({"ok": False, "errors": [f"usage: {msg}"]}))
        return 2
    remote = [d for d in ns.dirs if d.startswith("s3://")]
    if remote:
        return _verify_s3(ns, remote, emit)
    try:
        from ..export.verify.tree import verify_path

        cache: dict = {}
        reports = [verify_path(d, check_hashes=not ns.no_hash, cache=cache) for d in ns.dirs]
        hf = render.add_transformers(reports) if ns.transformers else {}
        obj = render.combined(reports, hf)
    except Exception as e:  # a bug of verify itself: reported, never taken for OK
        msg = f"verify failed: {type(e).__name__}: {e}"
        emit({"ok": False, "errors": [msg]}, [f"ERROR  {msg}"])
        return 1
    emit(obj, (line for r in reports for line in render.text_lines(r)))
    return 0 if all(r.ok for r in reports) else 1


def _verify_s3(ns, urls, emit) -> int:
    """``verify s3://bucket/prefix``: published snapshots against their manifests (consumers/publish/verify.py)."""
    if len(urls) != len(ns.dirs) or ns.transformers:
        msg = "give s3:// URLs alone (local directories and --transformers in another call)"
        print(f"paddle-fullparam verify: {msg}", file=sys.stderr)
        emit({"ok": False, "errors": [f"usage: {msg}"]}, [])
        return 2
    try:
        from ..consumers.publish.verify import verify_s3

        reports = [r for u in urls for r in verify_s3(u, ns.endpoint_url, check_hashes=not ns.no_hash)]
    except Exception as e:  # a bug of verify itself: reported, never taken for OK
        msg = f"verify failed: {type(e).__name__}: {e}"
        emit({"ok": False, "errors": [msg]}, [f"ERROR  {msg}"])
        return 1

    def lines():
        for r in reports:
            if r["kind"] == "not a snapshot":
                yield from (f"SKIPPED  {n}" for n in r["notes"])
                continue
            counts = f": {r['files']} files, {r['bytes']} bytes" if r["kind"] == "snapshot" else ""
            shown = f" ({'; '.join(r['notes'])})" if r["notes"] else ""
            yield f"{'OK' if r['ok'] else 'DAMAGED'}  {r['path']}{counts}{shown}"
            yield from (f"  - {e}" for e in r["errors"])

    ok = all(r["ok"] for r in reports)
    emit({"ok": ok, "snapshots": reports}, lines())
    return 0 if ok else 1


def _cmd_recipes(ns) -> int:
    from ..config.recipes import list_recipes, recipes_dir

    rows = list_recipes()
    if not rows:
        print(f"no recipes found in {recipes_dir()}", file=sys.stderr)
        return 1
    width = max(len(n) for n, _ in rows)
    for name, desc in rows:
        print(f"{name:<{width}}  {desc}")
    return 0


def _cmd_plan(ns) -> int:
    from ..plan.topology import plan_topology, plan_writes

    axes = [("data", ns.dp), ("pipe", ns.pp), ("sharding", ns.sharding), ("sep", ns.sep), ("expert", ns.ep),
            ("model", ns.mp)]
    try:
        topo = plan_topology(axes, ns.sharding_stage, [ns.experts_over] if ns.experts_over else ())
    except ValueError as e:
        print(f"paddle-fullparam plan: {e}", file=sys.stderr)
        return 2
    if ns.model:
        return _print_prediction(ns, topo)
    sizes = [1] * ns.files
    writes = plan_writes(topo, sizes)
    out = topo.as_dict()
    out["files"] = ns.files
    out["file_mesh"] = list(writes.file_mesh)
    out["writers"] = {str(r): fs for r, fs in sorted(writes.writers().items())}
    if ns.json:
        print(json.dumps(out))
        return 0
    print(f"world size {topo.world_size}: " + " x ".join(f"{n}={d}" for n, d in topo.axes) + f", sharding stage {topo.sharding_stage}")
    print(f"mesh rows (horizontal) over {', '.join(topo.horizontal_axes) or '-'}; columns (vertical) over pipe; "
          f"replicas over {', '.join(topo.replica_axes) or '-'}: {topo.num_splits} mesh(es) split the export")
    for m in topo.meshes:
        files = writes.files_of_mesh(m.index)
        print(f"  mesh {m.index}: rows {[list(r) for r in m.rows]}  files {files}")
    for r, fs in sorted(writes.writers().items()):
        print(f"  rank {r} writes files {fs}")
    return 0


def _model_shapes(spec: str):
    """(name -> shape, dtype) from a named model, a config.json, or a model.safetensors.index.json with its files."""
    from pathlib import Path

    from ..plan.model_shapes import decoder_shapes, preset

    path = Path(spec)
    if not path.exists():
        return preset(spec)
    if path.is_dir():
        path = next((path / n for n in ("model.safetensors.index.json", "config.json") if (path / n).exists()), path)
    data = json.loads(path.read_text())
    if "weight_map" not in data:
        return decoder_shapes(data)
    from .. import _dtypes
    from ..export.write.header import read_header

    shapes, dtypes = {}, set()
    for f in sorted(set(data["weight_map"].values())):
        if not (path.parent / f).exists():
            raise ValueError(f"{path}: the index names no shapes, and its file {f} is not beside it to read them from")
        _, entries, _ = read_header(path.parent / f)
        for name, entry in entries.items():
            shapes[name] = tuple(entry.shape)
            dtypes.add(entry.dtype)
    return shapes, _dtypes.BY_ST_CODE[sorted(dtypes)[0]].name if dtypes else "bfloat16"


def _print_prediction(ns, topo) -> int:
    from ..config.sizes import parse_size
    from ..plan.prediction import predict

    try:
        shapes, dtype = _model_shapes(ns.model)
        nodes = {r: r // ns.ranks_per_node for r in range(topo.world_size)}
        out = predict(shapes, ns.dtype or dtype, topo, parse_size(ns.max_shard_size), nodes)
    except (ValueError, OSError, KeyError) as e:
        print(f"paddle-fullparam plan: {e}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps({**topo.as_dict(), **out}))
        return 0
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    snap, ranks = out["snapshot_bytes"], out["ranks"]
    print(f"{ns.model}: {len(shapes)} tensors, {gb(snap)} GB ({ns.dtype or dtype}) in {out['files']} files of at most "
          f"{ns.max_shard_size}; world size {topo.world_size}: " + " x ".join(f"{n}={d}" for n, d in topo.axes if d > 1)
          + f", {ns.ranks_per_node} ranks per node")
    print("GB per rank   node  writes  receives (in node + across)  sends  floor  | seed schedule receives")
    for r, t in ranks.items():
        inside = t.get("received", 0) - t.get("received_cross_node", 0)
        print(f"  rank {r:<5} {out['nodes'][r]:>5}  {gb(t.get('writes', 0)):>6}  {gb(t.get('received', 0)):>8} "
              f"({gb(inside)} + {gb(t.get('received_cross_node', 0))})  {gb(t.get('sent', 0)):>10}  "
              f"{gb(t.get('floor', 0)):>5}  | {gb(t.get('seed_received', 0)):>6}")
    total = lambda k: sum(t.get(k, 0) for t in ranks.values())  # noqa: E731
    most = max(t.get("received", 0) for t in ranks.values())
    print(f"in all: received {gb(total('received'))} GB ({total('received') / snap:.2f}x the snapshot; the floor "
          f"{gb(total('floor'))} GB), across nodes {gb(total('received_cross_node'))} GB; most into one rank "
          f"{gb(most)} GB; seed schedule {gb(total('seed_received'))} GB ({total('seed_received') / snap:.2f}x), most "
          f"into one rank {gb(max(t.get('seed_received', 0) for t in ranks.values()))} GB")
    print(f"writers' balance: the largest writes {out['balance']:.2f}x the mean"
          + (f" ({out['balance_note']})" if out["balance_note"] else ""))
    return 0


def _cmd_convert(ns) -> int:
    """Exit 0 with the snapshot written, 1 if the checkpoint cannot be converted (nothing written), 2 for usage."""
    import logging

    from ..assemble.mapping import MappingError
    from ..convert.checkpoints import CheckpointError
    from ..convert.convert import convert
    from ..export.source import ExportError

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("paddle_fullparam_callbacks").setLevel(logging.INFO)
    try:
        info = convert(ns.checkpoint, ns.output_dir, config=ns.recipe, overrides=ns.overrides,
                       model_config=ns.config, step=ns.step, workers=ns.workers, base=ns.base,
                       lora_config=ns.lora_config, as_base=ns.as_base)
    except (CheckpointError, MappingError, ExportError) as e:
        print(f"paddle-fullparam convert: {e}", file=sys.stderr)
        return 1
    print(f"{info.path}  step {info.step}  {info.num_tensors} tensors  {info.files} file(s)  {info.bytes / 1e6:.1f} MB  "
          f"{info.seconds:.1f} s")
    if ns.as_base:
        print(f"the base for serve.adapter: start the engine on {info.path} (docs/serving.md)")
    return 0


def _cmd_demo(ns) -> int:
    from .demo import run_demo

    return run_demo(output_dir=ns.output_dir, recipe=ns.recipe, overrides=ns.overrides, steps=ns.steps)


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = argparse.ArgumentParser(prog="paddle-fullparam", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"paddle-fullparam {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="one of:")

    text = "train a tiny Llama on CPU with the PaddleFormers Trainer and FullParamExportCallback, then verify and list the snapshots"
    d = sub.add_parser("demo", help=text, description=text + ".")
    d.add_argument("--output-dir", default="demo_output", help="where the trainer and the snapshots write (default: demo_output)")
    d.add_argument("--recipe", default="demo_tiny_llama",
                   help="a bundled recipe name (see 'paddle-fullparam recipes') or a path to a YAML recipe (default: demo_tiny_llama)")
    d.add_argument("--steps", type=_count(1), default=40, help="training steps, a whole number >= 1 (default: 40)")
    d.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    d.set_defaults(func=_cmd_demo)

    text = "check snapshots (or every snapshot and pointer of an output directory) against their manifest and index"
    v = sub.add_parser("verify", help=text, description=text + "; exit 0 if all verify, 1 if any is damaged, 2 for usage errors.")
    v.add_argument("dirs", nargs="*", metavar="DIR",
                   help="a snapshot directory, an output directory (its hf-step-* snapshots and latest/best "
                        "pointers), a latest/best pointer file, or s3://bucket/prefix (published snapshots)")
    v.add_argument("--json", action="store_true", help="print one JSON object (exit 0 ok, 1 damaged, 2 usage)")
    v.add_argument("--no-hash", action="store_true", help="skip the checksums (sizes and headers only)")
    v.add_argument("--endpoint-url", help="for s3:// URLs: the store's endpoint (default: the AWS chain's, e.g. AWS_ENDPOINT_URL)")
    v.add_argument("--transformers", action="store_true",
                   help="also load each snapshot with transformers on the meta device (needs torch, transformers, "
                        "accelerate) and report missing, unexpected, mis-shaped and mis-typed tensors")
    v.set_defaults(func=_cmd_verify)

    text = "write a Hugging Face snapshot of a trainer checkpoint already on disk (PaddleFormers flex, PaddleNLP pdparams or unified)"
    c = sub.add_parser("convert", help=text, description=text + "; exit 0 written, 1 not convertible (nothing written), 2 usage.")
    c.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a trainer checkpoint directory, e.g. output/checkpoint-500")
    c.add_argument("--output-dir", required=True,
                   help="where the snapshot goes, named by export.name_template at the checkpoint's step (with latest)")
    c.add_argument("--config", metavar="MODEL_CONFIG",
                   help="the model's config.json (or its directory); needed for PaddleFormers flex checkpoints, which "
                        "hold none; otherwise the checkpoint's own config.json is used")
    c.add_argument("--base", metavar="PATH",
                   help="a LoRA checkpoint of LoRA tensors only (PaddleNLP's lora_model_state.pdparams): the base model "
                        "the run started from (its directory or a checkpoint of it)")
    c.add_argument("--lora-config", metavar="LORA_CONFIG",
                   help="a LoRA run's lora_config.json (or its directory) when the checkpoint holds none (PaddleFormers' "
                        "flex checkpoints): lora_alpha and rslora give the merge's scaling")
    c.add_argument("--as-base", action="store_true",
                   help="write the base model a serving engine starts on for a LoRA run served as adapters "
                        "(serve.adapter): a LoRA checkpoint's base weights without their update, a model saved in "
                        "Paddle's format (e.g. PaddleNLP's save_pretrained) as it is; step 0 unless one is recorded")
    c.add_argument("--recipe", help="a bundled recipe name or YAML path for the export settings (default: the defaults)")
    c.add_argument("--step", type=_count(0), help="the step to record when the checkpoint does not say (trainer_state)")
    c.add_argument("--workers", type=_count(1), default=1,
                   help="processes that write the snapshot's files in parallel, a whole number >= 1 (default 1)")
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP + "; e.g. export.dtype=bfloat16")
    c.set_defaults(func=_cmd_convert)

    add_consumer_commands(sub, OVERRIDES_HELP)

    text = ("print the meshes and writers of a hybrid-parallel topology, and with --model the bytes each rank will "
            "write, receive and send (nothing is launched)")
    pl = sub.add_parser("plan", help=text, description=text + ".")
    for flag, helptext in (("--dp", "data parallel degree"), ("--sharding", "sharding degree"), ("--pp", "pipeline degree"),
                           ("--mp", "tensor (model) parallel degree"), ("--sep", "sequence/context parallel degree")):
        pl.add_argument(flag, type=_count(1), default=1, help=f"{helptext}, a whole number >= 1 (default 1)")
    pl.add_argument("--ep", type=_count(1), default=1,
                    help="expert parallel degree: a dedicated axis whose ranks hold different experts (default 1)")
    pl.add_argument("--experts-over", choices=("data", "model", "sharding"),
                    help="the experts are spread over this existing axis instead (PaddleFormers' moe_group, e.g. data)")
    pl.add_argument("--sharding-stage", type=int, choices=(1, 2, 3), default=1,
                    help="1 or 2: sharding replicas split the work; 3: sharding joins the mesh (default 1)")
    pl.add_argument("--files", type=_count(1), default=8, help="number of shard files to assign to writers (default 8)")
    pl.add_argument("--model", help="predict each rank's bytes for this model: a name (Llama-2-7B, Llama-2-70B, "
                                    "Llama-3-8B, Mixtral-8x7B, ...), a config.json, or a model.safetensors.index.json "
                                    "with its files")
    pl.add_argument("--ranks-per-node", type=_count(1), default=8, help="with --model: ranks of a node, consecutive "
                                                                         "(as launchers place them; default 8)")
    pl.add_argument("--max-shard-size", default="5GB", help="with --model: export.max_shard_size (default 5GB)")
    pl.add_argument("--dtype", help="with --model: the snapshot's dtype (default the model's)")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    pl.set_defaults(func=_cmd_plan)

    from .selfcheck import add_parser as add_selfcheck

    add_selfcheck(sub)

    text = "list the bundled recipes with what each does"
    r = sub.add_parser("recipes", help=text, description=text + ".")
    r.set_defaults(func=_cmd_recipes)

    from .run import add_parser as add_run_parser

    add_run_parser(sub, OVERRIDES_HELP)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    from .run import split_command

    args, command = split_command(args)  # `run ... -- COMMAND ...`: COMMAND's own arguments are not ours
    try:
        ns, extra = parser.parse_known_args(args)
        if command is not None:
            ns.command_argv = command
        if extra:
            # overrides after an option (`convert CKPT --output-dir OUT key=value`): argparse has already
            # filled the positional list before the option, so they come back unrecognised
            if hasattr(ns, "overrides") and not any(x.startswith("-") for x in extra):
                ns.overrides = list(ns.overrides or []) + extra
            else:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:
        if e.code == 2 and args[:1] == ["verify"] and "--json" in args:
            # `verify --json` prints one JSON object whatever happens, usage errors included
            print(json.dumps({"ok": False, "errors": ["usage error (see stderr): paddle-fullparam verify [--json] "
                                                      "[--no-hash] [--transformers] DIR..."]}))
        raise
    from ..config.schema import ConfigError

    try:
        code = ns.func(ns)
        sys.stdout.flush()
        return code
    except ConfigError as e:
        print(f"paddle-fullparam: bad recipe value: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `paddle-fullparam plan ... | head`: the reader has gone; end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
