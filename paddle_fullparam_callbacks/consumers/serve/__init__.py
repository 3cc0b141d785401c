"""Serving (issue 39): each committed snapshot switched into running serving engines (vLLM), in place, with
no restart and no request dropped, while training goes on.

``engines/`` (each engine's protocol: the calls, their order, their errors; standard library only),
``swap.py`` (the swap process the runner starts: every engine at once), ``fit.py`` (whether the snapshots fit
an engine's model), ``probe.py`` (the start's proof), ``records.py`` (the record beside the snapshot),
``result.py`` (the record from what the swap left), ``hook.py`` (the coordinator's line of swaps, on the
consumers' hook base ``../hook.py``), ``recovery.py`` (what an earlier job's swaps left) and ``offline.py``
(``paddle-fullparam serve``).
"""
