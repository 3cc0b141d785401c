"""paddle_fullparam_callbacks' startup hook for a clone (``paddle-fullparam run`` puts this folder first
on PYTHONPATH; the installed wheel uses its ``.pth`` file instead).

Loads ``../startup.py`` by path when ``PADDLE_FULLPARAM_RECIPE`` is set (standard library only), then
runs the ``sitecustomize`` this file shadows, the next one on ``sys.path``, as Python would have run it.
"""
import os as _os
import sys as _sys


def _pfc_start(here):
    if not _os.environ.get("PADDLE_FULLPARAM_RECIPE", "").strip():
        return
    module = _sys.modules.get("_paddle_fullparam_startup")
    if module is None:  # importlib.machinery only (importlib.util costs ~10 ms of imports)
        from importlib.machinery import SourceFileLoader

        path = _os.path.join(_os.path.dirname(here), "startup.py")
        module = _sys.modules["_paddle_fullparam_startup"] = type(_sys)("_paddle_fullparam_startup")
        module.__file__ = path
        SourceFileLoader("_paddle_fullparam_startup", path).exec_module(module)
    module.install()


def _pfc_chain(here):
    """Run the sitecustomize found after this folder on sys.path (each one found later in the path
    than the one before, so a chain of several ends)."""
    from importlib.machinery import PathFinder

    def norm(entry):
        return _os.path.realpath(entry or _os.getcwd())

    entries = [norm(p) for p in _sys.path]
    start = entries.index(here) + 1 if here in entries else 0
    rest = [p for p, n in zip(_sys.path[start:], entries[start:]) if n != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = type(_sys)("sitecustomize")
    module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
    if spec.cached:
        module.__cached__ = spec.cached
    _sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_pfc_here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
_pfc_start(_pfc_here)
_pfc_chain(_pfc_here)
