"""Switching the callback on without code (``paddle-fullparam run`` and ``PADDLE_FULLPARAM_*``):
the live path's other door.

- ``startup``: the startup hook (standard library only, loaded by the wheel's ``.pth`` file or by
  ``sitedir/sitecustomize.py`` in every Python process of the tree); it does nothing unless
  ``PADDLE_FULLPARAM_RECIPE`` is set, and then only watches for a framework's trainer module.
- ``settings``: the environment variables, read, checked and written (``run`` and the ranks share it).
- ``patch``: what happens when PaddleFormers' or PaddleNLP's trainer module is imported: the Trainer
  classes are wrapped so that each Trainer built ends with exactly one ``FullParamExportCallback``.
- ``records``: what each process tells ``run`` (a small JSON file per Trainer in a directory ``run`` made).

Nothing here is imported by ``import paddle_fullparam_callbacks``.
"""
