"""A stand-in for PaddleFormers or PaddleNLP, small enough to import in milliseconds: the same module
path (``<framework>/trainer/trainer.py``), a ``Trainer`` whose ``callback_handler`` dispatches every event
through ``call_event`` (as both frameworks do), ``add_callback`` and ``_save_checkpoint``, and a
``.dist-info`` that gives the version. The startup hook's logic is tested against it without Paddle;
the real frameworks are tested in tests/test_pf_run.py and tests/test_pnlp_run.py.

    write_fake(folder, "paddleformers", "1.2.0")  -> folder to put first on the path
"""
from __future__ import annotations

from pathlib import Path

TRAINER = '''
class Args:
    def __init__(self, output_dir="fake_out"):
        self.output_dir = output_dir
        self.save_hf_steps = -1


class State:
    global_step = 0


class CallbackHandler:
    def __init__(self, callbacks):
        self.callbacks = []
        for cb in callbacks:
            self.add_callback(cb)

    def add_callback(self, callback):
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def call_event(self, event, args, state, control, **kwargs):
        for cb in self.callbacks:
            getattr(cb, event)(args, state, control, model=None, tokenizer=None, **kwargs)
        return control

    def on_init_end(self, args, state, control):
        return self.call_event("on_init_end", args, state, control)

    def on_train_begin(self, args, state, control):
        return self.call_event("on_train_begin", args, state, control)

    def on_step_end(self, args, state, control):
        return self.call_event("on_step_end", args, state, control)

    def on_evaluate(self, args, state, control, metrics=None):
        return self.call_event("on_evaluate", args, state, control, metrics=metrics)

    def on_train_end(self, args, state, control):
        return self.call_event("on_train_end", args, state, control)


class Trainer:
    def __init__(self, args=None, callbacks=None):
        self.args = args or Args()
        self.state = State()
        self.control = None
        self.events = []
        self.callback_handler = CallbackHandler(list(callbacks or []))
        self.callback_handler.on_init_end(self.args, self.state, self.control)

    def add_callback(self, callback):
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        self.callback_handler.callbacks.remove(callback)
        return callback

    def _save_checkpoint(self, model, metrics=None):
        self.events.append("own _save_checkpoint")

    def evaluate(self):
        self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics={"eval_loss": 1.0})

    def train(self):
        h = self.callback_handler
        h.on_train_begin(self.args, self.state, self.control)
        for step in (1, 2):
            self.state.global_step = step
            h.on_step_end(self.args, self.state, self.control)
        h.on_train_end(self.args, self.state, self.control)
'''


def write_fake(folder: Path, framework: str, version: str) -> Path:
    pkg = folder / framework
    (pkg / "trainer").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version + '.post'!r}\n")
    (pkg / "trainer" / "__init__.py").write_text("from .trainer import CallbackHandler, Trainer\n")
    (pkg / "trainer" / "trainer.py").write_text(TRAINER)
    dist = folder / f"{framework}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {framework}\nVersion: {version}\n")
    return folder
