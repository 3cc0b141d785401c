"""A fine-tuning script shaped like PaddleNLP's ``llm/run_finetune.py`` (written for these tests, no
code of it copied): its arguments in one JSON file read by ``PdArgumentParser``, the model and the
tokenizer from a local directory, ``{"src", "tgt"}`` JSON lines, its own Trainer subclass, which adds a
callback after ``super().__init__``, and its own callbacks list.

    python pnlp_finetune.py ARGS.json
    python -m paddle.distributed.launch --nproc_per_node 2 pnlp_finetune.py ARGS.json

Nothing in it knows of paddle_fullparam_callbacks, except what the test arguments below ask for:
``own_callback_dir`` (the script attaches its own FullParamExportCallback, late: after the Trainer is
built) and ``report`` (each rank writes what its Trainer ended with). ``PFC_TEST_GLOO_SAFE=1`` wraps the
argument parsing (TrainingArguments runs fleet.init) in the CPU/gloo group-creation fix of
``tests/multirank/harness.py``, a harness fix for several ranks on CPU only.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import paddle
from paddlenlp.data import DataCollatorForSeq2Seq
from paddlenlp.trainer import PdArgumentParser, Trainer, TrainerCallback, TrainingArguments
from paddlenlp.transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class ModelArgument:
    model_name_or_path: str = field(metadata={"help": "a local model directory (config, weights, tokenizer)"})


@dataclass
class DataArgument:
    dataset_name_or_path: str = field(metadata={"help": "a directory with train.json (one {src, tgt} per line)"})
    max_length: int = field(default=48, metadata={"help": "longest example, in tokens"})


@dataclass
class TestArgument:
    own_callback_dir: Optional[str] = field(default=None, metadata={"help": "attach an own FullParamExportCallback"})
    report: Optional[str] = field(default=None, metadata={"help": "each rank writes <report>.<rank>.json"})


class StepCounter(TrainerCallback):
    """The script's own callback (run_finetune.py passes its own list too)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class LossWatch(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


class CausalLMTrainer(Trainer):
    """A Trainer subclass that adds a callback after ``super().__init__``, as subclasses do."""

    def __init__(self, *args, watch=None, **kwargs):
        super().__init__(*args, **kwargs)
        if watch is not None:
            self.add_callback(watch)


def read_examples(path, tokenizer, max_length):
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            ex = json.loads(line)
            src = tokenizer(ex["src"])["input_ids"]
            tgt = tokenizer(" " + ex["tgt"])["input_ids"] + [tokenizer.eos_token_id]
            ids = (src + tgt)[:max_length]
            labels = ([-100] * len(src) + tgt)[:max_length]
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def main():
    parser = PdArgumentParser((ModelArgument, DataArgument, TrainingArguments, TestArgument))
    guard = contextlib.nullcontext()
    if os.environ.get("PFC_TEST_GLOO_SAFE") == "1":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "multirank"))
        import harness

        guard = harness.gloo_safe_group_creation()
    with guard:
        model_args, data_args, training_args, test_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    paddle.set_device(training_args.device)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype="float32")
    train_ds = read_examples(os.path.join(data_args.dataset_name_or_path, "train.json"), tokenizer, data_args.max_length)

    counter, watch = StepCounter(), LossWatch()
    trainer = CausalLMTrainer(
        model=model, args=training_args, train_dataset=train_ds, tokenizer=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer, padding=True, max_length=data_args.max_length,
                                             label_pad_token_id=-100, return_tensors="np"),
        callbacks=[counter], watch=watch,
    )
    if test_args.own_callback_dir:
        from paddle_fullparam_callbacks import attach

        attach(trainer, None, overrides=[f"output_dir={test_args.own_callback_dir}", "trigger.every_n_steps=2"])
    trainer.train()

    rank = paddle.distributed.get_rank()
    if test_args.report:
        ids = np.random.default_rng(7).integers(3, 512, (2, 12))
        model.eval()
        with paddle.no_grad():
            logits = model(paddle.to_tensor(ids))
        logits = (logits[0] if isinstance(logits, (tuple, list)) else getattr(logits, "logits", logits)).numpy()
        np.save(f"{test_args.report}.{rank}.ids.npy", ids)
        np.save(f"{test_args.report}.{rank}.logits.npy", logits.astype("float32"))
        fullparam = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "FullParamExportCallback"]
        with open(f"{test_args.report}.{rank}.json", "w") as f:
            json.dump({
                "rank": rank, "world": paddle.distributed.get_world_size(), "steps": counter.steps,
                "losses": watch.losses, "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
                "fullparam": [{"module": type(cb).__module__, "output_dir": str(cb._output_dir(training_args)),
                               "events": cb.events, "own": bool(test_args.own_callback_dir) and cb.config.output_dir == test_args.own_callback_dir}
                              for cb in fullparam],
            }, f)


if __name__ == "__main__":
    main()
