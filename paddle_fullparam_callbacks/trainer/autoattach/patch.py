"""The frameworks' Trainer classes, wrapped when their module is imported (``startup`` calls
:func:`patch_trainer_module`), so that every Trainer built ends with exactly one FullParamExportCallback.

Where it hooks, and why there:

- ``__init__`` of ``Trainer`` and of every subclass (wrapped as each subclass is defined, through
  ``__init_subclass__``): when the *outermost* ``__init__`` returns, the Trainer is complete (a
  subclass may add callbacks after ``super().__init__``). Then it is checked: a framework version the
  hook does not know, a subclass whose ``__init__`` never ran ``Trainer.__init__``, a Trainer without the
  callback handler the hook needs, or a bad ``PADDLE_FULLPARAM_*`` value raise :class:`AutoAttachError`
  naming it, from the constructor: never a training without snapshots.
- the Trainer's own ``callback_handler.call_event`` (every event goes through it): before each event
  (but ``on_init_end``) the callbacks are reconciled. If no FullParamExportCallback is there, one is
  added with :func:`~..attach.attach` (the checkpoint hook with it, when the recipe asks) before the
  first event, which is ``on_train_begin`` for a training: its checks run before step 1. A
  FullParamExportCallback the user adds (``callbacks=[...]``, ``add_callback``, ``attach``), at any
  time before training, wins: the wrapper's own is removed (with its checkpoint hook), one log line says so.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import sys
import weakref
from typing import Optional

from ...config.schema import ConfigError
from ..attach import _hook_checkpoints, attach
from ..callback import FullParamExportCallback
from .records import Record
from .settings import RunSettings
from .startup import OUTPUT_DIR, OVERRIDES, RECIPE

KNOWN_VERSIONS = {"paddleformers": ((1, 2), (1, 3)), "paddlenlp": ((2, 8), (2, 9))}
"""[lowest, highest) (major, minor) of each framework whose Trainer the hook was written and tested against."""
DISPLAY = {"paddleformers": "PaddleFormers", "paddlenlp": "PaddleNLP"}

_DEPTH, _BASE_DONE, _STATE = "_pfc_init_depth", "_pfc_base_init_done", "_pfc_autoattach"


class AutoAttachError(RuntimeError):
    """The hook was asked for snapshots (``PADDLE_FULLPARAM_RECIPE``) and cannot promise them for this Trainer."""


def _logger() -> logging.Logger:
    log = logging.getLogger("paddle_fullparam_callbacks.run")
    if not log.handlers:  # the frameworks configure their own loggers, not ours: these lines must show
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[paddle-fullparam] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return log


class _Framework:
    def __init__(self, name: str, module):
        self.name = name
        self.version = framework_version(name, module)
        low, high = KNOWN_VERSIONS[name]
        m = re.match(r"(\d+)\.(\d+)", self.version)
        self.known = bool(m) and low <= (int(m.group(1)), int(m.group(2))) < high
        self.expected = f"{low[0]}.{low[1]}.x" if (low[0], low[1] + 1) == high else f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"

    def __str__(self):
        return f"{DISPLAY[self.name]} {self.version}"


def framework_version(name: str, module=None) -> str:
    """The installed distribution's version next to the imported package (``__version__`` can lag:
    PaddleFormers 1.2.0 says 1.1.0.post), else ``__version__``, else ``unknown``."""
    from importlib import metadata

    top = sys.modules.get(name)
    where = getattr(top, "__file__", None)
    if where:
        for dist in metadata.Distribution.discover(name=name, path=[os.path.dirname(os.path.dirname(where))]):
            return dist.version
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return str(getattr(top, "__version__", None) or "unknown")


def patch_trainer_module(module, framework: str) -> None:
    """Wrap ``module.Trainer`` (and its subclasses, present and future) once."""
    base = getattr(module, "Trainer", None)
    fw = _Framework(framework, module)
    if not isinstance(base, type) or "__init__" not in vars(base):
        raise AutoAttachError(f"{module.__name__} ({fw}) has no Trainer class with an __init__: {RECIPE} is set but "
                              f"the startup hook cannot attach a FullParamExportCallback (it knows {DISPLAY[framework]} "
                              f"{fw.expected}); unset {RECIPE}, or attach() the callback in the training script")
    if vars(base).get("_pfc_patched"):
        return
    base.__init__ = _wrap_init(vars(base)["__init__"], fw, is_base=True)
    previous = vars(base).get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if previous is not None:
            previous.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _wrap_class(cls, fw)

    base.__init_subclass__ = classmethod(__init_subclass__)
    stack = list(base.__subclasses__())  # defined before the hook came (it was installed late)
    while stack:
        cls = stack.pop()
        _wrap_class(cls, fw)
        stack.extend(cls.__subclasses__())
    base._pfc_patched = True


def _wrap_class(cls, fw: _Framework) -> None:
    init = vars(cls).get("__init__")
    if init is not None and not getattr(init, "_pfc_wrapped", False):
        cls.__init__ = _wrap_init(init, fw, is_base=False)


def _wrap_init(init, fw: _Framework, is_base: bool):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        state = vars(self)
        depth = state.get(_DEPTH, 0)
        state[_DEPTH] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                state[_DEPTH] = depth
            else:
                state.pop(_DEPTH, None)
        if is_base:
            state[_BASE_DONE] = True
        if depth == 0:
            _built(self, fw)

    __init__._pfc_wrapped = True
    return __init__


class _Attachment:
    """What the hook knows of one Trainer: its config, the callback it added (if any), its record."""

    def __init__(self, settings: RunSettings, config, record: Record):
        self.settings, self.config, self.record = settings, config, record
        self.callback: Optional[FullParamExportCallback] = None
        self.attached = self.said_own = False


def _built(trainer, fw: _Framework) -> None:
    cls = type(trainer)
    name = cls.__name__
    record = Record(f"{cls.__module__}.{name}", fw.name, fw.version)
    try:
        if not fw.known:
            raise AutoAttachError(
                f"{RECIPE} asks for snapshots of {name}, but {fw} is not a version the startup hook knows (it knows "
                f"{DISPLAY[fw.name]} {fw.expected}): install a known version, or attach() the callback in the "
                f"training script, or unset {RECIPE}")
        if not vars(trainer).pop(_BASE_DONE, False):
            raise AutoAttachError(
                f"{RECIPE} asks for snapshots, but {cls.__module__}.{name}.__init__ returned without running "
                f"{DISPLAY[fw.name]}'s Trainer.__init__: the startup hook cannot reach this Trainer class; call "
                f"super().__init__(...) in it, or attach() the callback yourself, or unset {RECIPE}")
        handler = getattr(trainer, "callback_handler", None)
        if (not isinstance(getattr(handler, "callbacks", None), list) or not callable(getattr(handler, "call_event", None))
                or not callable(getattr(trainer, "add_callback", None))):
            raise AutoAttachError(
                f"{RECIPE} asks for snapshots, but {name} has no callback_handler with a callbacks list and call_event "
                f"(as {DISPLAY[fw.name]}'s Trainer has): the startup hook cannot reach this Trainer class; attach() "
                f"the callback yourself, or unset {RECIPE}")
        try:
            settings = RunSettings.from_environ()
            config = settings.load_config()
        except ConfigError as e:
            raise AutoAttachError(f"{RECIPE}={os.environ.get(RECIPE, '')!r} {OVERRIDES}="
                                  f"{os.environ.get(OVERRIDES, '')!r} {OUTPUT_DIR}={os.environ.get(OUTPUT_DIR, '')!r} "
                                  f"for {name}: {e}") from e
        if config.checkpoint_hook.enabled and not callable(getattr(trainer, "_save_checkpoint", None)):
            raise AutoAttachError(f"the recipe asks for checkpoint_hook.enabled, but {name} has no _save_checkpoint()")
    except AutoAttachError as e:
        record.update("refused", message=str(e))
        raise
    vars(trainer)[_STATE] = _Attachment(settings, config, record)
    _wrap_events(handler, weakref.ref(trainer))
    record.update("built")


def _wrap_events(handler, trainer_ref) -> None:
    call_event = handler.call_event
    if getattr(call_event, "_pfc_wrapped", False):
        return

    @functools.wraps(call_event)
    def reconciled_call_event(event, *args, **kwargs):
        trainer = trainer_ref()
        if trainer is not None and event != "on_init_end":
            reconcile(trainer)
        return call_event(event, *args, **kwargs)

    reconciled_call_event._pfc_wrapped = True
    handler.call_event = reconciled_call_event  # this handler object only


def is_fullparam_callback(cb) -> bool:
    """A FullParamExportCallback, also one of another copy of this package (a clone beside the wheel)."""
    return isinstance(cb, FullParamExportCallback) or any(
        c.__name__ == "FullParamExportCallback" and c.__module__.startswith("paddle_fullparam_callbacks.")
        for c in type(cb).__mro__)


def reconcile(trainer) -> None:
    """Exactly one FullParamExportCallback on ``trainer``: the user's if there is one, else the wrapper's."""
    st: Optional[_Attachment] = vars(trainer).get(_STATE)
    if st is None:
        return
    callbacks = trainer.callback_handler.callbacks
    theirs = [cb for cb in callbacks if is_fullparam_callback(cb) and cb is not st.callback]
    name = type(trainer).__name__
    if theirs:
        if st.callback is not None:
            _remove(trainer, st.callback, theirs)
            st.callback = None
        if not st.said_own:
            st.said_own = True
            _logger().info("%s already has a FullParamExportCallback: it keeps its own; %s adds none", name, RECIPE)
            st.record.update("own")
        return
    if st.attached:
        return
    st.attached = True
    cb = attach(trainer, st.config)
    st.callback = cb
    out = str(cb._output_dir(trainer.args).absolute()) if not cb.config.checkpoint_hook.enabled else \
        f"{os.path.abspath(trainer.args.output_dir)}/checkpoint-N/{cb.config.checkpoint_hook.subdir}"
    _logger().info("%s: FullParamExportCallback attached (%s); snapshots in %s", name, st.settings.describe(), out)
    st.record.update("attached", output_dir=out if not cb.config.checkpoint_hook.enabled else None,
                     snapshots=out)


def _remove(trainer, auto: FullParamExportCallback, theirs) -> None:
    """Take the wrapper's callback (and its checkpoint hook) off ``trainer``, for the user's own."""
    callbacks = trainer.callback_handler.callbacks
    if auto in callbacks:
        callbacks.remove(auto)
    if auto.session is not None and auto.session.is_open:
        auto.session.close()
    hooked = vars(trainer).get("_save_checkpoint")
    if getattr(hooked, "_pfc_callback", None) is auto:
        original = hooked.__wrapped__
        if getattr(original, "__self__", None) is trainer and getattr(original, "__func__", None) is \
                getattr(type(trainer), "_save_checkpoint", None):
            del vars(trainer)["_save_checkpoint"]
        else:
            trainer._save_checkpoint = original
        for cb in theirs:  # the user's attach() found the wrapper's hook in place and added none of its own
            if isinstance(cb, FullParamExportCallback) and cb.config.checkpoint_hook.enabled and not cb._hooked:
                _hook_checkpoints(trainer, cb)
