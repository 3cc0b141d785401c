"""``paddle-fullparam demo``: the main job, small enough for a CPU.

Trains a tiny Llama with the PaddleFormers Trainer on a short text (``demo_data/corpus.txt``) with
a real tokenizer (``demo_data/tokenizer/``, which every snapshot carries), with
:class:`FullParamExportCallback` attached, then verifies every snapshot and prints a table.
The builders here are also what the tests and benchmarks use.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import List, Optional

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


def make_tiny_llama(framework: str = "paddleformers", seed: int = 0, **overrides):
    """A Llama that trains on CPU (fuse_rms_norm=False: the fused kernel is GPU-only)."""
    import paddle

    paddle.seed(seed)
    kwargs = {**TINY_LLAMA, "fuse_rms_norm": False, **overrides}
    if framework == "paddleformers":
        from paddleformers.transformers import LlamaConfig, LlamaForCausalLM
    elif framework == "paddlenlp":
        from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM
    else:
        raise ValueError(f"unknown framework {framework!r}")
    return LlamaForCausalLM(LlamaConfig(**kwargs))


DEMO_DATA = Path(__file__).resolve().parent / "demo_data"
DEMO_TOKENIZER = DEMO_DATA / "tokenizer"
"""A SentencePiece BPE of 512 tokens learnt from the demo's text, as Llama tokenizers are
(``scripts/train_demo_tokenizer.py``): ``tokenizer.model`` with its transformers conversion
``tokenizer.json``; the tiny Llama's vocabulary, with its pad/bos/eos/unk ids 0/1/2/3."""
HELDOUT_TEXT = DEMO_DATA / "heldout.txt"
"""Text the demo never trains on: its evaluation set, and the default text of the perplexity evaluator."""


def demo_tokenizer():
    """The demo's tokenizer as PaddleFormers loads one (its ``save_pretrained`` writes what
    ``transformers.AutoTokenizer`` reads)."""
    from paddleformers.transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))


class TextDataset:
    """Windows of ``seq_len + 1`` tokens over a text, every ``stride`` tokens: next-token prediction."""

    def __init__(self, tokenizer, path: Path, seq_len: int = 32, stride: int = 16):
        import numpy as np

        ids = [i for line in Path(path).read_text().splitlines() if line.strip()
               for i in tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]]
        self.rows = [np.asarray(ids[i:i + seq_len + 1], dtype="int64")
                     for i in range(0, len(ids) - seq_len, stride)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        return {"input_ids": ids[:-1], "labels": ids[1:]}


class TokenDataset:
    """Generated sequences with a learnable pattern (next token = token + 1 mod vocab)."""

    def __init__(self, n: int = 256, seq_len: int = 32, vocab: int = 512, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        starts = rng.integers(0, vocab, n)
        self.rows = [((s + np.arange(seq_len)) % vocab).astype("int64") for s in starts]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def trainer_args(framework: str, output_dir: str, steps: int, **overrides):
    common = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=10, save_steps=max(1, steps // 2), report_to=[], disable_tqdm=True,
        seed=0, device="cpu",
    )
    if framework == "paddleformers":
        from paddleformers.trainer import TrainingArguments

        common.update(amp_master_grad=False)
    else:
        from paddlenlp.trainer import TrainingArguments
    common.update(overrides)
    return TrainingArguments(**common)


def make_trainer(framework: str, model, args, callbacks, train_dataset=None, eval_dataset=None, tokenizer=None):
    if framework == "paddleformers":
        from paddleformers.trainer import Trainer
    else:
        from paddlenlp.trainer import Trainer
    kwargs = {} if tokenizer is None else {"tokenizer": tokenizer}
    return Trainer(
        model=model, args=args, train_dataset=train_dataset or TokenDataset(),
        eval_dataset=eval_dataset, callbacks=list(callbacks), **kwargs,
    )


def quiet_framework_logs() -> None:
    """PaddleFormers logs every step at INFO; the demo keeps its warnings and our own lines."""
    try:
        from paddleformers.utils.log import logger as pf_logger

        pf_logger.set_level("WARNING")
    except Exception:  # older/other versions: leave their logging alone
        pass


class _Above(logging.Filter):
    """Drops a framework's records below ``level`` (a filter on the logger: it outlives the level the
    framework sets on its own logger when it is imported)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def silence_framework_chatter() -> None:
    """The demo prints its own lines and its table: the frameworks' import-time notices and per-save INFO
    lines are silenced here, for the demo's process only (a library user's logging is never touched).
    Errors still show. Called before Paddle, PaddleFormers or transformers are imported."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "PyTorch was not found ..."
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for module in (r"paddle(\.|$)", r"paddleformers(\.|$)", r"_distutils_hack"):  # ccache, empty state dict, ...
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
    for name in ("PaddleFormers",  # "Due to potential compatibility issues ...", flag notices
                 "paddle.distributed.fleet.utils.log_util"):  # flex checkpoint: "... wrote the metadata to the file."
        logging.getLogger(name).addFilter(_Above(logging.ERROR))


DEMO_MARKER = ".paddle-fullparam-demo"
"""Written into the demo's ``--output-dir``: a later demo there may replace its ``snapshots/`` and ``trainer/``."""



def check_steps(steps) -> int:
    """The demo's ``--steps``: a whole number >= 1. (The Trainer reads ``max_steps <= 0`` as "train a whole
    epoch", which with the demo's data is 64 steps and, with demo_tiny_llama, 64 snapshots.)"""
    import operator

    from ..config.schema import ConfigError

    try:
        n = None if isinstance(steps, bool) else operator.index(steps)  # int or numpy int; not 2.5, "3", True
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ConfigError("--steps", f"must be a whole number >= 1 (the demo's training steps); got {steps!r}")
    return n


class _DemoRecorder:
    """The demo's own listener: each evaluation's metrics by step, and the stall values the exporter
    logs through ``trainer.log`` (``fullparam/stall_s``)."""

    def __init__(self):
        self.metrics = {}  # step -> {name: value}
        self.stalls = []
        self.evaluations = []  # what the evaluation hook logged (fullparam/eval/<key>)

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics[int(state.global_step)] = dict(metrics or {})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "fullparam/stall_s" in logs:
            self.stalls.append(logs["fullparam/stall_s"])
        if logs and any(k.startswith("fullparam/eval/") for k in logs):
            self.evaluations.append({k: v for k, v in logs.items() if k.startswith("fullparam/eval/")})


def _prepare_output(out: Path) -> None:
    """Start from a clean ``snapshots/`` and ``trainer/``: a second demo in the same place would be a new
    run meeting the first run's snapshots (which it must not replace). Only what an earlier demo made
    (its marker file is there) is removed; anything else stops the demo before it starts."""
    import shutil

    from ..config.schema import ConfigError

    parts = [out / "snapshots", out / "trainer"]
    present = [p for p in parts if p.exists() or p.is_symlink()]
    if present and not (out / DEMO_MARKER).is_file():
        raise ConfigError(
            "--output-dir", f"{out} already holds {', '.join(p.name + '/' for p in present)} and no {DEMO_MARKER} "
                            "marker (not made by this demo); remove them or choose another --output-dir",
        )
    for p in present:  # all checked before anything is removed
        if p.is_symlink() or not p.is_dir():
            raise ConfigError("--output-dir", f"{p} is not a directory made by the demo; remove it or choose "
                                              "another --output-dir")
    for p in present:
        shutil.rmtree(p)
    if present:
        print(f"removed the previous demo's {', '.join(p.name + '/' for p in present)} in {out}")
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("made by `paddle-fullparam demo`; a later demo here replaces snapshots/ and trainer/\n")


def _fmt_metric(v) -> str:
    return f"{v:.6f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def run_demo(output_dir: str = "demo_output", recipe: Optional[str] = "demo_tiny_llama",
             overrides: Optional[List[str]] = None, steps: int = 40) -> int:
    """Train the tiny Llama ``steps`` steps with the recipe's exporter attached (``attach()``, so the
    checkpoint hook works); recipes that export after evaluations or track a metric get an evaluation
    set and an evaluation every ``max(1, steps // 4)`` steps. Prints a table and returns the exit status
    (0: every snapshot verifies). ``steps`` < 1 raises :class:`ConfigError` (``--steps: ...``)."""
    steps = check_steps(steps)
    silence_framework_chatter()
    from ..export.commit.pointers import read_pointer
    from ..export.verify.snapshot import verify_snapshot
    from ..trainer.attach import attach
    from ..trainer.callback import FullParamExportCallback
    from . import demo_eval

    out = Path(output_dir).resolve()
    # the recipe and overrides are checked before anything is written or trained
    cb = FullParamExportCallback.from_recipe(
        recipe, overrides=[f"output_dir={out / 'snapshots'}", *(overrides or [])]
    )
    cfg = cb.config
    demo_eval.check(cfg)  # the evaluator's interpreter, before anything is written
    _prepare_output(out)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_framework_logs()

    metric = cfg.retention.metric
    evaluate = bool(cfg.trigger.on_evaluate or demo_eval.trainer_metric(cfg))
    tokenizer = demo_tokenizer()
    train_dataset = TextDataset(tokenizer, DEMO_DATA / "corpus.txt")
    extra, eval_dataset, eval_steps = {}, None, None
    if evaluate:
        eval_steps = max(1, steps // 4)
        eval_dataset = TextDataset(tokenizer, HELDOUT_TEXT)
        extra = dict(evaluation_strategy="steps", eval_steps=eval_steps, per_device_eval_batch_size=4)
    n = cfg.trigger.every_n_steps
    print(f"demo: recipe {recipe or '(defaults)'}, {steps} steps"
          + (f", evaluation every {eval_steps} steps on {len(eval_dataset)} held-out windows" if evaluate else ""))
    print(f"training text: {len(train_dataset)} windows of the demo's text, its {len(tokenizer)}-token tokenizer "
          "(every snapshot carries it)")
    if n and n > steps:
        print(f"note: trigger.every_n_steps={n} is more than the {steps} steps of the demo, so it never fires here; "
              f"scale it, e.g. trigger.every_n_steps={max(1, steps // 4)}")

    model = make_tiny_llama("paddleformers")
    args = trainer_args("paddleformers", str(out / "trainer"), steps, **extra)
    recorder = _DemoRecorder()
    trainer = make_trainer("paddleformers", model, args, [recorder], train_dataset=train_dataset,
                           eval_dataset=eval_dataset, tokenizer=tokenizer)
    attach(trainer, cb)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    snaps_dir = cb.session.output_dir if cb.session else out / "snapshots"
    where = f"{out / 'trainer'}/checkpoint-N/{cfg.checkpoint_hook.subdir}" if cfg.checkpoint_hook.enabled else snaps_dir
    print()
    waited = f" (with {cb.evaluation.waited_s:.1f} s waiting for evaluations at the end)" if cb.evaluation.waited_s else ""
    print(f"trained {steps} steps in {train_s:.1f} s{waited}; snapshots in {where}")
    name_w = max([18] + [len(_display_name(s, out)) for s in cb.snapshots])
    cols = f"{'snapshot':<{name_w}} {'step':>5} {'reason':<14} {'files':>5} {'bytes':>10} {'seconds':>8} {'stall_s':>8}"
    if metric:
        cols += f" {metric:>12}"
    header = cols + "  verify"
    print(header)
    print("-" * len(header))
    ok = True
    tracked = {}  # snapshot name -> metric value (kept or removed)
    pointers = {p: read_pointer(snaps_dir, p) for p in ("latest", "best")}
    for s in cb.snapshots:
        manifest = None
        if s.path is not None and s.path.exists():
            v = verify_snapshot(s.path)
            status = "ok" if v.ok else "FAILED: " + "; ".join(v.errors[:2])
            ok &= v.ok
            tags = [p for p, target in pointers.items() if target == s.name and s.path.parent == snaps_dir]
            if tags:
                status += f" ({' and '.join(tags)})"
            try:
                manifest = json.loads((s.path / "fullparam_manifest.json").read_text())
            except (OSError, ValueError):
                manifest = None
        else:
            status = "removed by retention" if s.path is not None and s.path.parent == snaps_dir else "removed"
        line = (f"{_display_name(s, out):<{name_w}} {s.step:>5} {s.reason:<14} {s.files:>5} {s.bytes:>10} "
                f"{s.seconds:>8.4f} {s.stall_s:>8.4f}")
        if metric:
            value = (manifest or {}).get("metrics", {}).get(metric)
            if value is None:
                value = recorder.metrics.get(s.step, {}).get(metric)
            if value is None:  # evaluate.<score>: the evaluation hook's
                value = demo_eval.score(cb, s.name, metric)
            if value is not None:
                tracked[s.name] = float(value)
            line += f" {_fmt_metric(value):>12}"
        print(line + f"  {status}")
    if cb.errors:
        ok = False
        for e in cb.errors:
            print(f"export error: {e}")
    ok &= demo_eval.print_evaluations(cb, recorder.evaluations)
    if pointers["latest"]:
        print(f"latest -> {pointers['latest']}")
    if metric:
        ok &= _print_best(snaps_dir, pointers["best"], metric, cfg.retention.mode, tracked,
                          len(recorder.metrics) or len(cb.evaluation.results))
    if cfg.export.async_write and cb.snapshots:
        waited = sum(s.stall_s for s in cb.snapshots)
        took = sum(s.seconds for s in cb.snapshots)
        print(f"background writes (export.async_write, export.max_pending_bytes={cfg.export.max_pending_bytes}): "
              f"training waited {waited:.4f} s in all, the exports took {took:.4f} s")
    if recorder.stalls:
        print("training stall logged through trainer.log as fullparam/stall_s: "
              + ", ".join(f"{x:.4f}" for x in recorder.stalls))
    return 0 if ok and cb.snapshots else 1


def _display_name(s, out: Path) -> str:
    """``hf-step-000010``, or ``checkpoint-10/hf`` for a snapshot inside a trainer checkpoint."""
    if s.path is not None and s.path.parent.name.startswith("checkpoint-"):
        return f"{s.path.parent.name}/{s.path.name}"
    return s.name


def _print_best(snaps_dir: Path, best: Optional[str], metric: str, mode: str, tracked: dict, evaluations: int) -> bool:
    """``best -> NAME (metric value: the lowest of N snapshots)``; False when ``best`` is missing or wrong."""
    word = "lowest" if mode == "min" else "highest"
    if not tracked:
        print(f"best: no snapshot has {metric} (there were {evaluations} evaluations)")
        return False
    pick = (min if mode == "min" else max)(tracked, key=tracked.get)
    if best is None:
        print(f"best: no pointer in {snaps_dir}, expected {pick} ({metric} {tracked[pick]:.6f})")
        return False
    if best not in tracked or tracked[best] != tracked[pick]:
        print(f"best -> {best}: WRONG, {pick} has the {word} {metric} ({tracked[pick]:.6f})")
        return False
    print(f"best -> {best} ({metric} {tracked[best]:.6f}: the {word} of {len(tracked)} snapshots, "
          f"{evaluations} evaluations)")
    return True
