"""What the zoo tests of both environments share: run the two halves once, check one case."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import fp8_zoo  # noqa: E402  (tests/zoo, on the path of its importers)
import mm_zoo  # noqa: E402

HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-4  # fp32 logits, max abs diff
# per case, the digest of where every element of the snapshot comes from (run_zoo.mapping_digest),
# recorded before the presets became declarations: a change of any mapping shows here. After a
# deliberate change, record the new digest of that case (the zoo's results.json has it)
GOLDEN = json.loads((HERE / "golden_mappings.json").read_text())


def run_suite(framework: str, out: Path, hf_python: str):
    """Paddle half in this environment's interpreter, transformers half in the hf one; one process each."""
    proc = subprocess.run([sys.executable, str(HERE / "run_zoo.py"), framework, str(out)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {e["id"]: e for e in json.loads((out / "results.json").read_text())}
    proc = subprocess.run([hf_python, str(HERE / "hf_check.py"), str(out / "results.json")],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    hf = json.loads(proc.stdout.strip().splitlines()[-1])
    return results, hf


def check_case(case, entry: dict, hf: dict) -> None:
    assert "fatal" not in entry, entry.get("traceback", entry.get("fatal"))
    if case.refused:
        # a mapping known to be wrong: refused before training, with the cause named, nothing written
        assert entry["refused_error"] and re.search(case.refused, entry["refused_error"]), entry["refused_error"]
        assert entry["written"] == [], entry["written"]
        return
    assert entry["errors"] == [], entry["errors"]
    assert entry["snapshot"], "no snapshot was committed"
    assert entry.get("mapping_digest") == GOLDEN.get(case.id), (
        f"{case.id}: the snapshot's elements come from other places than recorded in golden_mappings.json")
    snapshot = Path(entry["snapshot"])
    assert "error" not in hf, hf.get("error")
    # names, shapes and dtypes as transformers' own loader sees them: nothing missing or extra
    v = hf["verify"]
    assert v["ok"], v
    assert v["architecture"] == case.hf_class
    config = json.loads((snapshot / "config.json").read_text())
    assert config["architectures"] == [case.hf_class]
    assert "torch_dtype" not in config and config["dtype"] == "float32"
    assert not any(k.endswith(("parallel_size", "parallel_degree")) and v not in (1, None) for k, v in config.items())
    if case.tied is not None:
        assert entry["tied"] is case.tied and config["tie_word_embeddings"] is case.tied
    notes = entry.get("manifest_model") or {}
    if entry.get("padding_row") is not None:
        # the embedding's padding row: zeros in the snapshot when untied, kept (and said) when tied
        key = "padding_row_kept" if entry["tied"] else "padding_rows_zeroed"
        assert list(notes.get(key, {}).values()) == [entry["padding_row"]], notes
    if case.extra.get("multimodal"):  # image-text-to-text (mm_zoo.py): text and one image, processor files
        mm_zoo.check(case, entry, hf)
    else:
        if case.no_forward is None:
            assert hf["class"] == case.hf_class
            assert hf["max_abs_diff"] is not None and hf["max_abs_diff"] <= TOLERANCE, hf
            if case.reload is None:  # the framework's own from_pretrained, single process, same logits
                assert entry.get("reload_error") is None, entry.get("reload_error")
                assert entry["reload_max_abs_diff"] <= TOLERANCE, entry
            else:  # a known defect of the framework's loader: still there (else this case should say so)
                assert entry.get("reload_error") or entry["reload_max_abs_diff"] > TOLERANCE, entry
        check_use(hf)
    for expected in case.extra.get("repairs", ()):
        assert any(expected in r for r in notes.get("mapping_repairs", [])), notes
    fp8_zoo.check(case, entry, hf)  # the same model exported as FP8


def check_use(hf: dict) -> None:
    """Used as people use a snapshot: its tokenizer, generate, and what llama.cpp's converter checks."""
    use, gg = hf["use"], hf["gguf"]
    assert "error" not in use, use.get("error")
    assert use["vocab"] == 512 and len(use["generated_ids"]) == 8 and use["text"].strip(), use
    assert use["missing_keys"] == use["unexpected_keys"] == use["mismatched_keys"] == [], use
    assert gg.get("vocab_size") == 512 and gg["special_tokens"].get("bos") == 1, gg
    assert gg.get("unmapped", []) == [], gg  # every tensor has its GGUF name (where llama.cpp maps them 1:1)


def zoo_tests(framework: str):
    """(fixture, test) for a test module of one environment: the two halves run once per module,
    then one test per case."""
    import pytest

    from case import all_cases

    cases = all_cases(framework)

    @pytest.fixture(scope="module")
    def zoo(tmp_path_factory, hf_python):
        return run_suite(framework, tmp_path_factory.mktemp("zoo"), hf_python)

    @pytest.mark.parametrize("case", cases, ids=[c.id for c in cases])
    def test_zoo(zoo, case):
        results, hf = zoo
        check_case(case, results[case.id], hf[case.id])

    return zoo, test_zoo
