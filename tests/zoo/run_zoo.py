"""The Paddle half of the model zoo, one process per framework environment.

    python tests/zoo/run_zoo.py {paddleformers|paddlenlp} OUT_DIR [--only SUBSTRING]

For every case of that framework (``cases_*.py``): build the tiny model, give its embedding's
padding row (if any) nonzero values, as pretrained weights have, train it 3 steps with the
framework's real Trainer and ``FullParamExportCallback`` at default settings (one snapshot, at the
end of training), then record Paddle's logits on ids that include 0, pad, bos and eos, and reload
the snapshot into the framework single-process. Cases whose forward cannot run here are exported
without training. Writes ``OUT_DIR/results.json``: one entry per case, for ``hf_check.py`` and the
tests; the same model is exported once more as FP8 (``fp8_zoo.py``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1])]

from _helpers import paddle_logits  # noqa: E402
from case import ZooCase, all_cases  # noqa: E402
import fp8_zoo  # noqa: E402
import mm_zoo  # noqa: E402

STEPS = 3
SEQ = 16


def special_ids(config) -> list:
    ids = [0]
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(config, key, None)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if isinstance(v, int) and 0 <= v < config.vocab_size:
            ids.append(v)
    return ids


def input_ids(config, without=None) -> np.ndarray:
    """Random ids with the special ids in them (``without``: an id left out, replaced by another)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, config.vocab_size, (2, SEQ))
    specials = special_ids(config)
    if without is not None:
        ids[ids == without] = (without + 1) % config.vocab_size
        specials = [i for i in specials if i != without]
    ids[0, : len(specials)] = specials  # specials at the start of one row
    ids[1, -len(specials):] = specials  # and inside the context of the other
    return ids


def install_shims(names) -> None:
    """Stand-ins for modules that cannot be installed here, imported at module level by frameworks
    whose classes under test do not use them (PaddleFormers 1.2's qwen2/qwen3/MoE modules import
    paddlefleet's gpt_provider; fused_a2a imports paddlefleet_ops)."""
    import dataclasses
    import types

    if "gpt_provider" in names and "paddleformers.transformers.gpt_provider" not in sys.modules:
        mod = types.ModuleType("paddleformers.transformers.gpt_provider")

        @dataclasses.dataclass
        class GPTModelProvider:
            transform_rules = {}

        mod.GPTModelProvider = GPTModelProvider
        sys.modules[mod.__name__] = mod
    if "paddlefleet_ops" in names and "paddlefleet_ops" not in sys.modules:
        mod = types.ModuleType("paddlefleet_ops")
        mod.is_deep_ep_available = lambda: False
        sys.modules["paddlefleet_ops"] = mod
    if "triton" in names and "triton" not in sys.modules:
        # PaddleFormers' triton_kernels/rope_triton.py decorates with @triton.jit at import; version
        # "0.0" makes its is_available() False, so the Paddle rope path runs
        tri, lang = types.ModuleType("triton"), types.ModuleType("triton.language")
        tri.__version__, tri.jit, tri.cdiv = "0.0", (lambda fn=None, **kw: fn or (lambda f: f)), (lambda a, b: -(-a // b))
        lang.constexpr, tri.language = object, lang
        sys.modules.update({"triton": tri, "triton.language": lang})


def build(case: ZooCase, seed: int = 0):
    import paddle

    install_shims(case.shims)
    mod = importlib.import_module(case.module)
    paddle.seed(seed)
    config = getattr(mod, case.config_class)(**case.config)
    model = getattr(mod, case.model_class)(config)
    return config, model


def padding_row(model) -> "int | None":
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    pad = getattr(emb, "_padding_idx", None)
    if pad is None:
        return None
    return int(pad if pad >= 0 else emb.weight.shape[0] + pad)


def is_tied(model) -> bool:
    """Whether the LM head is the input embedding, by identity of the parameters (the case states
    what its author read in the model's code; the test compares the two)."""
    from paddle_fullparam_callbacks.models.model_info import output_embedding

    return output_embedding(model, model.sharded_state_dict())[1]


def set_row(model, row: int) -> None:
    """Nonzero values in the embedding's padding row (Paddle's init leaves it zero; pretrained
    weights do not), so the test sees whether the snapshot computes what Paddle computes."""
    import paddle

    weight = model.get_input_embeddings().weight
    with paddle.no_grad():
        weight[row] = paddle.full([weight.shape[1]], 0.5, dtype=weight.dtype)


def mapping_digest(prepared) -> str:
    """What decides the snapshot's bytes given the model's tensors: every destination's name, shape
    and dtype, the source region and postprocessing (transposes, casts) of each of its slices, and
    the rows written as zeros. Temporary names of a mapping's intermediate steps are not in it, so
    two mappings that move every element to the same place have the same digest."""
    import hashlib

    from _digest import destination_slices

    parts = [(name, *destination_slices(prepared.dmap, name)) for name in sorted(prepared.dmap.entries)]
    parts.append(sorted(prepared.zero_rows.items()))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def train_with_callback(case: ZooCase, model, work: Path):
    from paddle_fullparam_callbacks import FullParamExportCallback
    from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_trainer, trainer_args

    cb = FullParamExportCallback(output_dir=str(work / "snapshots"), overrides=tokenizer_overrides(case))
    args = trainer_args(case.framework, str(work / "trainer"), STEPS, save_steps=10_000)
    vocab = int(case.config.get("vocab_size", 512))
    trainer = make_trainer(case.framework, model, args, [cb], train_dataset=TokenDataset(n=16, vocab=vocab),
                           tokenizer=trainer_tokenizer(case))
    trainer.train()
    return cb


def trainer_tokenizer(case: ZooCase):
    """PaddleFormers cases: the Trainer is given the demo's tokenizer (512 tokens, the zoo's vocabulary),
    as a user gives a Trainer its tokenizer; the snapshot gets what its save_pretrained writes."""
    if case.framework != "paddleformers":
        return None
    from paddle_fullparam_callbacks.cli.demo import demo_tokenizer

    return demo_tokenizer()


def tokenizer_overrides(case: ZooCase) -> list:
    """PaddleNLP cases (its environment has no `tokenizers` library to load that tokenizer): the same
    files through export.tokenizer, as for a trainer without a tokenizer."""
    from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER

    return [] if case.framework == "paddleformers" else [f"export.tokenizer={DEMO_TOKENIZER}"]


def export_without_training(model, work: Path):
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER

    cfg = load_config(None, [f"output_dir={work / 'snapshots'}", f"export.tokenizer={DEMO_TOKENIZER}"])
    session = ExportSession(cfg, cfg.output_dir)
    session.start()
    return session.export(build_model_source(model, cfg), 0, reason="zoo"), session


def reload_logits(case: ZooCase, snapshot: Path, ids: np.ndarray, mode: str) -> np.ndarray:
    """The snapshot loaded back single-process by the framework itself, from a copy (PaddleNLP's
    torch-format loader writes a model_state.pdparams next to the weights it converts)."""
    import shutil

    copy = snapshot.parent.parent / "reload" / snapshot.name
    shutil.copytree(snapshot, copy)
    snapshot = copy
    mod = importlib.import_module(case.module)
    cls = getattr(mod, case.model_class)
    if case.framework == "paddleformers":
        model = cls.from_pretrained(str(snapshot), convert_from_hf=True, dtype="float32")
    else:
        model = cls.from_pretrained(str(snapshot), convert_from_torch=True, dtype="float32")
    return paddle_logits(model, ids, mode)


def run_case(case: ZooCase, out: Path) -> dict:
    work = out / case.id
    work.mkdir(parents=True, exist_ok=True)
    entry = {"id": case.id, "framework": case.framework, "hf_class": case.hf_class, "forward": case.no_forward is None}
    t0 = time.perf_counter()
    config, model = build(case)
    entry["padding_row"] = row = padding_row(model)
    entry["tied"] = tied = is_tied(model)
    if row is not None and not tied:
        set_row(model, row)
    if case.refused:
        try:
            train_with_callback(case, model, work)
            entry["refused_error"] = None
        except Exception as e:
            entry["refused_error"] = f"{type(e).__name__}: {e}"
        snaps = work / "snapshots"
        entry["written"] = sorted(p.name for p in snaps.iterdir() if p.name != ".fullparam.lock") if snaps.exists() else []
        return entry
    mm = case.extra.get("multimodal")
    if case.train:
        cb = mm_zoo.train(case, model, work) if mm else train_with_callback(case, model, work)
        entry["events"], entry["errors"] = list(cb.events), list(cb.errors)
        snapshots = [s for s in cb.snapshots if s.path is not None]
        snapshot = snapshots[-1].path if snapshots else None
        session = cb.session
    else:
        info, session = export_without_training(model, work)
        entry["events"], entry["errors"] = ["zoo@0"], []
        snapshot = info.path
    if session is not None and session._prepared is not None:
        entry["mapping_digest"] = mapping_digest(session._prepared)
    entry["snapshot"] = str(snapshot) if snapshot else None
    if snapshot is not None:
        entry["manifest_model"] = json.loads((Path(snapshot) / "fullparam_manifest.json").read_text()).get("model")
        entry["fp8"] = dict(fp8_zoo.export(case, model, work), multimodal=bool(mm))  # the same model, FP8
    if mm and case.no_forward is None:  # text and one image (mm_zoo.py), and the reload
        entry.update(mm_zoo.record(case, model, work, lambda ids: reload_logits(case, Path(snapshot), ids, "eval")))
    elif case.no_forward is None:
        # tied with a padding row: the row is also an output row, so the snapshot keeps it (and says
        # so) and transformers embeds that id as the row where Paddle gives zeros: compare without it
        ids = input_ids(config, without=row if (row is not None and tied) else None)
        np.save(work / "ids.npy", ids)
        mode = case.extra.get("forward_mode", "eval")
        logits = paddle_logits(model, ids, mode)
        np.save(work / "logits.npy", logits)
        entry["ids"], entry["logits"] = str(work / "ids.npy"), str(work / "logits.npy")
        if snapshot is not None:
            try:
                entry["reload_max_abs_diff"] = float(np.max(np.abs(reload_logits(case, Path(snapshot), ids, mode) - logits)))
            except Exception as e:  # reported, the test decides
                entry["reload_error"] = f"{type(e).__name__}: {e}"[:2000]
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("framework", choices=["paddleformers", "paddlenlp"])
    ap.add_argument("out")
    ap.add_argument("--only", default="")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    from paddle_fullparam_callbacks.cli.demo import quiet_framework_logs

    quiet_framework_logs()
    for case in all_cases(ns.framework):
        if ns.only and ns.only not in case.id:
            continue
        try:
            entry = run_case(case, out)
        except Exception as e:
            entry = {"id": case.id, "fatal": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        results.append(entry)
        print(json.dumps({k: entry.get(k) for k in ("id", "seconds", "errors", "fatal", "reload_max_abs_diff", "reload_error")}),
              flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
