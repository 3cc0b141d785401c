"""The order in which test files reach pytest-xdist's workers: the longest first.

``--dist loadfile`` hands each worker whole files in collection order (two to start, then one each time a worker
finishes one), unless xdist reorders them by their number of tests (its default, off in the Makefile): that put the
long files of few tests (the crash loop, serving, lm-eval) last, and one worker ran them for minutes while the other
sat idle (1.7 min of a 30.7 min pass). Longest first (the classic LPT rule) leaves only short files for the end.
The weights are the seconds each file took in a clean-clone ``make test`` on this kind of machine (2026-12-05,
``--durations=0``, both passes); only the order depends on them, never a result, and a file not listed counts as
short. Update them when a file's time changes by minutes.
"""
from __future__ import annotations

from typing import Dict, List

SECONDS: Dict[str, int] = {
    # the PaddleFormers pass
    "tests/test_pf_benches.py": 479, "tests/test_pf_lm_eval.py": 360, "tests/test_pf_multirank.py": 218,
    "tests/test_pf_serve.py": 220, "tests/test_pf_run.py": 177, "tests/test_pf_recipes_demo.py": 175,
    "tests/test_pf_crash_loop.py": 155, "tests/test_install.py": 154, "tests/test_pf_convert.py": 139,
    "tests/test_pf_fp8.py": 137, "tests/test_pf_nodes.py": 133, "tests/test_pf_pipe.py": 119,
    "tests/unit/test_pf_verify_fuzz.py": 96, "tests/test_pf_on_device.py": 96, "tests/test_pf_zoo.py": 89,
    "tests/test_pf_expert_parallel.py": 87, "tests/test_pf_publish.py": 68, "tests/test_pf_lora.py": 52,
    "tests/test_pf_tokenizer.py": 51, "tests/test_pf_selfcheck.py": 48, "tests/test_pf_publish_engine.py": 45,
    "tests/test_pf_evaluate.py": 42, "tests/test_pf_export.py": 41,
    # the PaddleNLP pass
    "tests/test_pnlp_tensor_parallel.py": 217, "tests/test_pnlp_convert.py": 115, "tests/test_pnlp_serve.py": 90,
    "tests/test_pnlp_run.py": 84,
    "tests/test_pnlp_lora.py": 62, "tests/test_pnlp_zoo.py": 50, "tests/test_pnlp_llama.py": 23,
    "tests/test_pnlp_on_device.py": 21,
    # both passes
    "tests/test_fake_device.py": 44, "tests/unit/test_fp8.py": 36, "tests/unit/test_lm_eval.py": 27,
    "tests/unit/test_run_command.py": 25, "tests/unit/test_serve.py": 25, "tests/unit/test_run_hook.py": 25,
}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(nodeids: List[str]) -> List[int]:
    """The positions of ``nodeids`` in their new order: files by their weight, longest first; the tests of a file
    stay together and in their order, and files of equal weight keep theirs (a stable sort)."""
    return sorted(range(len(nodeids)), key=lambda i: -SECONDS.get(file_of(nodeids[i]), 0))
