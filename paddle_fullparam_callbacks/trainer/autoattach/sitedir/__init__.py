"""The folder ``paddle-fullparam run`` puts first on ``PYTHONPATH`` when the package is not installed
from its wheel (a clone): it holds only ``sitecustomize.py``, which loads the startup hook and then
runs the ``sitecustomize`` it shadows. (This ``__init__`` is never imported through that path.)"""
