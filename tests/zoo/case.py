"""One row of the model zoo: a tiny model of one architecture, how to build it, what to expect.

Cases live in ``cases_*.py`` next to this file (one module per family). ``run_zoo.py`` trains each
case of one framework with its real Trainer and the callback, in one process; ``hf_check.py`` loads
every snapshot with transformers, in one process of the ``hf`` environment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass(frozen=True)
class ZooCase:
    id: str  # unique, e.g. "pnlp-gpt-untied"
    framework: str  # "paddlenlp" | "paddleformers"
    module: str  # where the classes live, e.g. "paddlenlp.transformers"
    config_class: str  # e.g. "GPTConfig"
    model_class: str  # e.g. "GPTForCausalLM"
    config: Dict[str, object]  # tiny config kwargs (vocab_size <= 512 so the shared dataset fits)
    hf_class: str  # the transformers class the snapshot must load as, e.g. "GPT2LMHeadModel"
    # None: Paddle's forward runs here and logits are compared (fp32, max abs diff <= 1e-4);
    # otherwise why not, and only names, shapes and dtypes are compared with transformers' model
    no_forward: Optional[str] = None
    train: bool = True  # trained a few steps by the real Trainer (False only with a reason in no_forward)
    tied: Optional[bool] = None  # expected tie of the snapshot (None: whatever the config says)
    reload: Optional[str] = None  # None: reloads in its own framework with from_pretrained; else why not
    # a regex: the export must be refused with this error at on_train_begin, nothing written
    # (a mapping known to be wrong that this package cannot repair)
    refused: Optional[str] = None
    # modules that cannot be installed here, replaced by stand-ins before import (the class under
    # test does not use them; the framework imports them at module level): "gpt_provider", "paddlefleet_ops", "triton"
    shims: tuple = ()
    notes: str = ""
    extra: Dict[str, object] = field(default_factory=dict)


def all_cases(framework: Optional[str] = None) -> list:
    """Every case of every ``cases_*.py`` module here (pure data: importable without Paddle)."""
    import importlib
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if str(here) not in sys.path:
        sys.path.insert(0, str(here))
    cases, seen = [], set()
    for path in sorted(here.glob("cases_*.py")):
        for case in importlib.import_module(path.stem).CASES:
            if case.id in seen:
                raise ValueError(f"zoo case id {case.id!r} is used twice")
            seen.add(case.id)
            if framework is None or case.framework == framework:
                cases.append(case)
    return cases
