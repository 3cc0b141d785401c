"""Every size that decides a chunk or a path of the byte path has tests that cross it (issue 46: the rule, not the
example).

The byte path's modules name each such constant at their top (DESIGN.md, "Sizes: every branch reached"). This test
finds them (module-level names in those modules that carry a size word: BYTES, CHUNK, SUB, ELEMENTS, ROWS, BLOCK...,
with a numeric value) and holds the list below: each constant with the test files that cross it. A new constant
fails here until it is listed with its tests; a listed test file that no longer mentions the constant (or the
parameter that stands for it) fails too. docs/development.md prints the same table for a reader.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "paddle_fullparam_callbacks"
BYTE_PATH = ["host", "assemble", "export/write", "export/session", "export/verify", "models/lora", "convert", "plan",
             "consumers/publish/upload.py", "consumers/publish/verify.py", "consumers/serve"]
SIZE_WORDS = ("BYTES", "CHUNK", "SUB", "ELEMENTS", "ROWS", "BLOCK", "STAGE", "EVERY", "SMALL", "SHARE", "CELLS", "IOV",
              "PARTS", "MIB", "SIZE", "CAP", "FLOOR", "ALIGN", "LIMIT")
_ASSIGN = re.compile(r"^(_?[A-Z][A-Z0-9_]*)\s*(?::[^=]+)?=\s*(.+)$")

U = "tests/unit/"
# "module:NAME" -> {test file: the word that file must contain (the name, or the parameter standing for it)}
CROSSED = {
    "host/quantize.py:_CHUNK": {U + "test_sizes_fp8.py": "_CHUNK"},
    "host/fp8.py:_SUB": {U + "test_sizes_fp8.py": "_SUB"},
    "host/casts.py:_SUB": {U + "test_sizes_host.py": "_SUB", U + "test_sizes_lora.py": "_SUB"},
    "host/copy.py:STAGE_BYTES": {U + "test_sizes_host.py": "STAGE_BYTES", U + "test_sizes_lora.py": "STAGE_BYTES",
                                 U + "test_sizes_write.py": "STAGE_BYTES"},
    "host/copy.py:_SMALL": {U + "test_sizes_host.py": "_SMALL", U + "test_sizes_write.py": "_SMALL"},
    "host/lazy.py:MATERIALIZE_BLOCK": {U + "test_sizes_host.py": "MATERIALIZE_BLOCK"},
    "models/lora/product.py:_ROWS_ELEMENTS": {U + "test_sizes_lora.py": "_ROWS_ELEMENTS"},
    "models/lora/product.py:_GEMM_ROWS": {U + "test_sizes_lora.py": "_GEMM_ROWS"},
    "assemble/device.py:CHUNK_BYTES": {"tests/on_device/single.py": "CHUNK_BYTES"},
    "assemble/device.py:TIMED_BYTES": {"tests/on_device/single.py": "TIMED_BYTES"},
    # an allocation rounded up to ALIGN must fit the budget: the on-device cases' 16000-byte budget is no multiple
    "assemble/device.py:ALIGN": {"tests/on_device/single.py": "16KB", "tests/_on_device.py": "16000"},
    "assemble/mesh.py:BCAST_CHUNK_BYTES": {"tests/multirank/export_job.py": "BCAST_CHUNK_BYTES",
                                           "tests/test_pf_multirank.py": "--chunk"},
    "export/write/writer.py:_BLOCK_BYTES": {U + "test_sizes_write.py": "_BLOCK_BYTES"},
    "export/write/writer.py:_POOL_BLOCKS": {U + "test_sizes_write.py": "_POOL_BLOCKS"},
    "export/write/writer.py:_BLOCKS_PER_THREAD": {U + "test_sizes_write.py": "_BLOCKS_PER_THREAD"},
    "export/write/writer.py:_POOL_SHARE": {U + "test_sizes_write.py": "_POOL_SHARE"},
    "export/write/writer.py:_PIECE_BYTES": {U + "test_sizes_write.py": "_PIECE_BYTES"},
    "export/write/writer.py:_WRITEBACK_EVERY": {U + "test_sizes_write.py": "_WRITEBACK_EVERY"},
    "export/session/ring_size.py:AVAILABLE_SHARE": {U + "test_ring_size.py": "avail // 2"},
    "export/session/ring_size.py:UNKNOWN_CAP": {U + "test_ring_size.py": "UNKNOWN_CAP"},
    "export/verify/paths.py:MAX_JSON_BYTES": {U + "test_verify_hardened.py": "MAX_JSON_BYTES"},
    "export/verify/fp8_blocks.py:MAX_BLOCKS_NAMED": {U + "test_fp8_verify_blocks.py": "MAX_BLOCKS_NAMED"},
    "export/verify/tree.py:POINTER_LIMIT": {U + "test_verify_hardened.py": "POINTER_LIMIT"},
    "convert/checkpoints/_base.py:_MAX_GRID_CELLS": {U + "test_sizes_convert.py": "_MAX_GRID_CELLS"},
    "convert/checkpoints/_reads.py:_MIN_RUN_BYTES": {U + "test_sizes_convert.py": "_MIN_RUN_BYTES"},
    "convert/checkpoints/_reads.py:_IOV_MAX": {U + "test_sizes_convert.py": "_IOV_MAX"},
    "convert/checkpoints/_reads.py:GATED_BYTES": {U + "test_sizes_convert.py": "GATED_BYTES"},
    "plan/naming.py:MAX_NAME_BYTES": {U + "test_naming.py": "MAX_NAME_BYTES"},
    "plan/placement.py:SPLIT_FLOOR": {U + "test_routing.py": "split_floor=1"},
    "plan/placement.py:BALANCE_LIMIT": {U + "test_routing.py": "BALANCE_LIMIT"},
    # the default block; every block size from 1 up is drawn there
    "plan/quantization.py:DEFAULT_BLOCK": {U + "test_sizes_fp8.py": "block"},
    "consumers/publish/upload.py:MAX_PARTS": {"paddle_fullparam_callbacks/consumers/publish/upload.py": "200_000"},
    "consumers/publish/upload.py:MIB": {"tests/test_pf_publish_engine.py": "11 * MIB + 3"},
    "consumers/publish/verify.py:CHUNK": {U + "test_sizes_write.py": "CHUNK"},
}


def size_constants() -> set:
    found = set()
    for place in BYTE_PATH:
        path = PACKAGE / place
        for module in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            for line in module.read_text().splitlines():
                m = _ASSIGN.match(line)
                if not m or not any(w in m.group(1) for w in SIZE_WORDS):
                    continue
                value = m.group(2).split("#")[0].strip()
                if re.match(r"^(\(?\s*\d|min\(|max\()", value):  # a number (or a rule of numbers), not a table
                    found.add(f"{module.relative_to(PACKAGE).as_posix()}:{m.group(1)}")
    return found


def test_every_size_constant_of_the_byte_path_is_listed_with_tests_that_cross_it():
    found = size_constants()
    unlisted = sorted(found - set(CROSSED))
    assert not unlisted, (f"size constants with no test listed as crossing them: {unlisted}; shrink each in a test "
                          "(both sides of it, an independent implementation, poisoned scratch) and list it here")
    gone = sorted(set(CROSSED) - found)
    assert not gone, f"listed constants that no longer exist: {gone}"


def test_each_listed_test_exists_and_reaches_the_constant():
    for constant, tests in CROSSED.items():
        for test, word in tests.items():
            path = ROOT / test
            assert path.is_file(), (constant, test)
            assert word in path.read_text(), f"{test} no longer mentions {word!r}, how it crosses {constant}"
