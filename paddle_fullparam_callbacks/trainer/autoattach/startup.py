"""The startup hook: every Python process of a ``paddle-fullparam run`` tree (or of a job that sets
``PADDLE_FULLPARAM_RECIPE``) runs :func:`install` at start, from the wheel's
``paddle_fullparam_callbacks.pth`` or from ``sitedir/sitecustomize.py``.

It imports nothing but the standard library, and is loaded by file path under the name
``_paddle_fullparam_startup`` (importing ``paddle_fullparam_callbacks`` would cost a few hundred
milliseconds in every process). Unless ``PADDLE_FULLPARAM_RECIPE`` is set it does nothing. When it
is set, it puts one finder first on ``sys.meta_path`` that answers ``None`` for every module but the
frameworks' trainer modules; when one of those has been executed, it hands the module to
``autoattach.patch`` (which imports this package, Paddle being loaded by then anyway).
"""
import os
import sys

RECIPE = "PADDLE_FULLPARAM_RECIPE"
"""A bundled recipe name, a recipe file, or ``default`` (the package's defaults): switches the hook on."""
OUTPUT_DIR = "PADDLE_FULLPARAM_OUTPUT_DIR"
"""Where the snapshots go (default: ``<TrainingArguments.output_dir>/fullparam``)."""
OVERRIDES = "PADDLE_FULLPARAM_OVERRIDES"
"""Recipe overrides, whitespace-separated ``key=value`` (shell quoting for a value with spaces)."""
RUN_DIR = "PADDLE_FULLPARAM_RUN_DIR"
"""Set by ``paddle-fullparam run``: the directory where each process records the Trainers it built."""

MODULE_NAME = "_paddle_fullparam_startup"
TRAINER_MODULES = {"paddleformers.trainer.trainer": "paddleformers", "paddlenlp.trainer.trainer": "paddlenlp"}
"""The modules that define the frameworks' ``Trainer`` class, and the framework of each."""


def active(environ=None) -> bool:
    return bool((environ if environ is not None else os.environ).get(RECIPE, "").strip())


class _TrainerModuleFinder:
    """First on ``sys.meta_path``: ``None`` (no opinion) for every module but the trainer modules,
    whose loader it asks the other finders for, then lets it run with a hook after it."""

    _pfc_startup_finder = True

    def find_spec(self, name, path=None, target=None):
        framework = TRAINER_MODULES.get(name)
        if framework is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None or getattr(exec_module, "_pfc_hooked", False):
            return spec

        def exec_then_patch(module):
            exec_module(module)
            _trainer_module_loaded(module, framework)

        exec_then_patch._pfc_hooked = True
        loader.exec_module = exec_then_patch  # this module's own loader object only
        return spec

    def invalidate_caches(self):
        pass


PATCH = "paddle_fullparam_callbacks.trainer.autoattach.patch"
"""The heavy side, imported by name when a trainer module has run: this file is loaded outside the package
(by path, before anything of it is imported) and depends on nothing of it, as an entry point would not."""


def _trainer_module_loaded(module, framework):
    import importlib

    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        patch = importlib.import_module(PATCH)
    except ImportError:
        # the process sees the hook (PYTHONPATH from `run`) but not the package: the copy the hook came from
        if package_root not in sys.path:
            sys.path.append(package_root)
        patch = importlib.import_module(PATCH)
    patch.patch_trainer_module(module, framework)


def installed() -> bool:
    return any(getattr(f, "_pfc_startup_finder", False) for f in sys.meta_path)


def install() -> bool:
    """Put the finder in place when ``PADDLE_FULLPARAM_RECIPE`` is set (once per process, whichever
    copy of the hook comes first); a trainer module already imported is patched now. Returns whether
    the hook is active."""
    if not active():
        return False
    sys.modules.setdefault(MODULE_NAME, sys.modules.get(__name__))
    if installed():
        return True
    sys.meta_path.insert(0, _TrainerModuleFinder())
    for name, framework in TRAINER_MODULES.items():
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "Trainer"):
            _trainer_module_loaded(module, framework)
    return True

