"""A PaddleNLP Llama (untied, tied, LoRA) exporting from the fake accelerator in one process: within the
device budget, and the same bytes as from CPU tensors (see tests/test_pf_on_device.py for the rest)."""
from __future__ import annotations

import pytest

from _on_device import check_single_process, single_process

pytestmark = [pytest.mark.paddlenlp, pytest.mark.slow]


def test_one_process_on_the_device_exports_the_cpu_bytes_within_the_budget(tmp_path):
    check_single_process(single_process("paddlenlp", tmp_path))
