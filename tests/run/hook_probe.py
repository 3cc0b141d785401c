"""Scenarios of Trainers built under the startup hook, against the fake framework (tests/run/fake_framework.py)
first on the path. Run by tests/unit/test_run_hook.py as

    PADDLE_FULLPARAM_RECIPE=... PYTHONPATH=<sitedir>:<fake>:<checkout> python hook_probe.py FRAMEWORK SCENARIO...

and prints one ``PROBE {json}`` line per scenario: the FullParamExportCallbacks each Trainer ends with
(``auto``: the one the hook added, ``own``: the user's), whose checkpoint hook is in place, the error a
construction raised (type and message), and the log lines the hook wrote.
"""
from __future__ import annotations

import importlib
import io
import json
import logging
import sys


def main():
    framework, scenarios = sys.argv[1], sys.argv[2:]
    log = io.StringIO()
    mod = importlib.import_module(f"{framework}.trainer")
    Trainer = mod.Trainer
    from paddle_fullparam_callbacks import FullParamExportCallback, attach

    logging.getLogger("paddle_fullparam_callbacks.run").addHandler(logging.StreamHandler(log))

    def own(**kw):
        return FullParamExportCallback(None, overrides=["output_dir=own_snaps"], **kw)

    class AddsAfterInit(Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(own())

    class Middle(Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.middle = True

    class Outer(Middle):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.outer = True

    class NoSuper(Trainer):
        def __init__(self):
            self.args = None

    class OddHandler(Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.callback_handler = object()

    def build(scenario):
        if scenario == "plain":
            t = Trainer()
        elif scenario == "in_constructor":
            t = Trainer(callbacks=[own()])
        elif scenario == "subclass_adds_after_init":
            t = AddsAfterInit()
        elif scenario == "add_callback_after_construction":
            t = Trainer()
            t.add_callback(own())
        elif scenario == "attach_after_construction":
            t = Trainer()
            attach(t, None, overrides=["output_dir=own_snaps"])
        elif scenario == "attach_after_first_event":  # evaluate() before train(), then the user's attach
            t = Trainer()
            t.evaluate()
            attach(t, "checkpoint_hook", overrides=["output_dir=own_snaps"])
        elif scenario == "deep_subclass":
            t = Outer()
            assert t.middle and t.outer
        elif scenario == "no_super":
            t = NoSuper()
        elif scenario == "odd_handler":
            t = OddHandler()
        elif scenario == "two_trainers":
            Trainer().train()
            t = Trainer()
        else:
            raise SystemExit(f"unknown scenario {scenario}")
        t.train()
        return t

    for scenario in scenarios:
        log.truncate(0)
        log.seek(0)
        out = {"scenario": scenario}
        try:
            t = build(scenario)
        except Exception as e:
            out["error"] = [type(e).__name__, str(e)]
        else:
            st = vars(t).get("_pfc_autoattach")
            auto = st.callback if st is not None else None
            cbs = [cb for cb in t.callback_handler.callbacks if type(cb).__name__ == "FullParamExportCallback"]
            out["fullparam"] = ["auto" if cb is auto else "own" for cb in cbs]
            hook = vars(t).get("_save_checkpoint")
            owner = getattr(hook, "_pfc_callback", None)
            out["checkpoint_hook"] = None if owner is None else ("auto" if owner is auto else "own")
            out["recipe_of_auto"] = None if auto is None else auto.config.trigger.every_n_steps
            out["init_state_left"] = sorted(k for k in vars(t) if k in ("_pfc_init_depth", "_pfc_base_init_done"))
        out["log"] = [ln for ln in log.getvalue().splitlines() if ln]
        out["hook_loaded"] = "_paddle_fullparam_startup" in sys.modules
        out["init_wrapped"] = bool(getattr(Trainer.__init__, "_pfc_wrapped", False))
        print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
