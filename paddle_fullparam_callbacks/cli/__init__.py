"""Layer 6: the ``paddle-fullparam`` command (``main``: demo, convert, verify, plan, recipes) and
the demo's tiny Llama and Trainer (``demo``)."""
