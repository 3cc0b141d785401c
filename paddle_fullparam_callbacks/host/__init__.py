"""Layer between assemble and config: the byte work an export does on the host's cores.

The worker threads of ``export.threads`` (``pool.py``), strided copies into file order (``copy.py``),
casts between floating dtypes with Paddle's bits (``casts.py``), and arrays computed block by block
on those threads when they are written (``lazy.py``: a cast, a LoRA merge). Knows nothing of
models, plans or files."""
