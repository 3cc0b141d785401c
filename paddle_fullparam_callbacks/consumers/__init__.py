"""Between the trainer and export: the consumers of committed snapshots, each job in a process of its
own while training goes on: the evaluation hook (``evaluate/``) and the publisher (``publish/``),
both built on one hook base (``hook.py``: the line of committed snapshots, worker threads, drain,
wait-then-stop, the running record, adoption of what an earlier job left running) and one runner
process (``runner.py``). They read snapshots that ``export/`` committed and never write one; the
trainer connects them to its commits, the CLI runs them after training."""
