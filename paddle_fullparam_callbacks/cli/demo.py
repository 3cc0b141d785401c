"""``paddle-fullparam demo``: the main job, small enough for a CPU.

Trains a tiny Llama with the PaddleFormers Trainer on generated token sequences, with
:class:`FullParamExportCallback` attached, then verifies every snapshot and prints a table.
The builders here are also what the tests and benchmarks use.
"""
from __future__ import annotations

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


def make_trainer(framework: str, model, args, callbacks, train_dataset=None, eval_dataset=None):
    if framework == "paddleformers":
        from paddleformers.trainer import Trainer
    else:
        from paddlenlp.trainer import Trainer
    return Trainer(
        model=model, args=args, train_dataset=train_dataset or TokenDataset(),
        eval_dataset=eval_dataset, callbacks=list(callbacks),
    )


def quiet_framework_logs() -> None:
    """PaddleFormers logs every step at INFO; the demo keeps its warnings and our own lines."""
    try:
        from paddleformers.utils.log import logger as pf_logger

        pf_logger.set_level("WARNING")
    except Exception:  # older/other versions: leave their logging alone
        pass


def run_demo(output_dir: str = "demo_output", recipe: Optional[str] = "demo_tiny_llama",
             overrides: Optional[List[str]] = None, steps: int = 40) -> int:
    from ..export.verify import verify_snapshot
    from ..integrations.callback import FullParamExportCallback

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_framework_logs()
    out = Path(output_dir).resolve()
    cb = FullParamExportCallback.from_recipe(
        recipe, overrides=[f"output_dir={out / 'snapshots'}", *(overrides or [])]
    )
    model = make_tiny_llama("paddleformers")
    args = trainer_args("paddleformers", str(out / "trainer"), steps)
    trainer = make_trainer("paddleformers", model, args, [cb])
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    print()
    print(f"trained {steps} steps in {train_s:.1f} s; snapshots in {cb.session.output_dir if cb.session else out}")
    header = f"{'snapshot':<18} {'step':>5} {'reason':<14} {'files':>5} {'bytes':>10} {'seconds':>8}  verify"
    print(header)
    print("-" * len(header))
    ok = True
    for s in cb.snapshots:
        if s.path is not None and s.path.exists():
            v = verify_snapshot(s.path)
            status = "ok" if v.ok else "FAILED: " + "; ".join(v.errors[:2])
            ok &= v.ok
        else:
            status = "removed by retention"
        print(f"{s.name:<18} {s.step:>5} {s.reason:<14} {s.files:>5} {s.bytes:>10} {s.seconds:>8.3f}  {status}")
    if cb.errors:
        ok = False
        for e in cb.errors:
            print(f"export error: {e}")
    if cb.session is not None:
        latest = (cb.session.output_dir / "latest")
        if latest.exists():
            print(f"latest -> {latest.read_text().strip()}")
    return 0 if ok and cb.snapshots else 1
