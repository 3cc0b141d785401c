"""Serving (issue 39): each committed snapshot switched into running serving engines (vLLM), in place, with
no restart and no request dropped, while training goes on.

``engines/`` (each engine's protocol: the calls, their order, their errors; standard library only),
``agent.py`` (the job's swap agent: every engine at once) and ``agent_client.py`` (the hook's end of it),
``fit.py`` (whether the snapshots fit an engine's model), ``probe.py`` (the start's proof), ``records.py`` (the
record beside the snapshot), ``result.py`` (the record from what the swap left), ``hook.py`` (the coordinator's
line of swaps, on the consumers' hook base ``../hook.py``), ``recovery.py`` (what an earlier job's swaps left),
``offline.py`` (``paddle-fullparam serve``); for a LoRA run served as adapters (issue 48), ``adapters.py`` (the
names each engine loads and unloads, what it holds) and ``adapter_start.py`` (the start's proof of the run's
adapter and base on each engine).
"""
