"""Snapshots carry a tokenizer, or the job says at start that they will not: the trainer's tokenizer,
``export.tokenizer``'s files, the demo's real tokenizer (a SentencePiece model, as Llama's); tried with
transformers (tokenizer, model, ``generate``), with llama.cpp's gguf package (what its converter checks of
its input) and with llama.cpp's ``convert_hf_to_gguf.py`` itself (the GGUF's tensors are the snapshot's)."""
from __future__ import annotations

import filecmp
import json
import logging
import subprocess

import pytest

pytestmark = [pytest.mark.paddleformers, pytest.mark.hf_client]

from paddle_fullparam_callbacks import FullParamExportCallback  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import (  # noqa: E402
    DEMO_TOKENIZER, demo_tokenizer, make_tiny_llama, make_trainer, run_demo, trainer_args,
)
from paddle_fullparam_callbacks.config import ConfigError, load_config  # noqa: E402
from paddle_fullparam_callbacks.models.tokenizer import NO_TOKENIZER  # noqa: E402

from _helpers import ROOT, use_snapshots  # noqa: E402


def _train(tmp_path, *overrides, tokenizer=None, steps=2):
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 'snaps'}", "trigger.on_train_end=true",
                                                  *overrides])
    args = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, save_steps=1000)
    make_trainer("paddleformers", make_tiny_llama(seed=1), args, [cb], tokenizer=tokenizer).train()
    assert cb.errors == [] and cb.snapshots
    return cb.snapshots[-1].path


@pytest.fixture(scope="module")
def demo_snapshot(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    assert run_demo(str(out), steps=8, overrides=["trigger.every_n_steps=4"]) == 0
    return out / "snapshots" / "hf-step-000008"


def test_demo_snapshots_load_with_their_tokenizer_and_generate_text(demo_snapshot, hf_python):
    snapshot = demo_snapshot
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in snapshot.iterdir()}
    report = use_snapshots(hf_python, snapshot)[str(snapshot)]
    hf, gg = report["transformers"], report["gguf"]
    assert "error" not in hf, hf
    assert hf["vocab"] == 512 and hf["missing_keys"] == hf["unexpected_keys"] == hf["mismatched_keys"] == []
    tok = demo_tokenizer()  # the same ids on both sides: the tokenizer travelled unchanged
    assert hf["prompt_ids"] == tok("The river town")["input_ids"]
    assert len(hf["generated_ids"]) == 8 and hf["text"].strip(), hf
    assert gg["vocab_size"] == 512 and gg["special_tokens"] == {"bos": 1, "eos": 2, "unk": 3, "pad": 0}, gg
    assert gg["vocab_model"] == "llama" and gg["gguf_arch"] == "LLAMA" and gg["unmapped"] == [] and gg["tensors"] == 21


def test_llama_cpps_converter_turns_a_demo_snapshot_into_a_gguf_of_the_same_tensors(demo_snapshot, hf_python,
                                                                                   llama_cpp_converter, tmp_path):
    data = ROOT / "paddle_fullparam_callbacks" / "cli" / "demo_data"
    proc = subprocess.run([hf_python, str(ROOT / "tests" / "hf_client" / "convert_gguf.py"), llama_cpp_converter,
                           str(demo_snapshot), str(tmp_path / "demo.gguf"), str(data / "corpus.txt"),
                           str(data / "heldout.txt")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["returncode"] == 0 and "Model successfully exported" in r["output"], r["output"][-3000:]
    # every weight, bit for bit (q and k in llama.cpp's rotary row order, which the check undoes)
    assert r["tensors"] == 21 and r["gguf_only"] == r["snapshot_only"] == r["unequal"] == [], r
    assert r["permuted"] == [f"blk.{i}.attn_{m}.weight" for i in (0, 1) for m in "kq"], r
    # the tokenizer as a SentencePiece ('llama') vocabulary: every piece, score and type, the special ids
    v = r["vocab"]
    assert v["architecture"] == v["model"] == "llama" and v["tokens"] == v["sentencepiece_vocab"] == 512, v
    assert v["pieces_equal"] and v["scores_equal"] and v["types_equal"], v
    assert v["special"] == {"bos": 1, "eos": 2, "unknown": 3, "padding": 0}, v
    # transformers reads the same tokenizer from the snapshot: the ids sentencepiece gives, line for line
    t = r["transformers"]
    assert t["class"] == "LlamaTokenizer" and t["lines"] > 70 and t["differ"] == [], t


def test_a_trainer_without_a_tokenizer_is_told_once_at_start(tmp_path, caplog, hf_python):
    with caplog.at_level(logging.WARNING, logger="paddle_fullparam_callbacks"):
        snapshot = _train(tmp_path, "trigger.every_n_steps=1", steps=2)
    said = [r for r in caplog.records if r.getMessage() == NO_TOKENIZER]
    assert len(said) == 1  # once, for the whole job (two exports here)
    assert not [p for p in snapshot.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))]
    report = use_snapshots(hf_python, snapshot)[str(snapshot)]
    # what people meet with such a snapshot: no tokenizer for transformers, none for llama.cpp's converter
    assert "error" in report["transformers"] and "tokenizer.json" in report["gguf"]["vocab_error"]


def test_export_tokenizer_gives_a_trainer_without_one_its_files(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="paddle_fullparam_callbacks"):
        snapshot = _train(tmp_path, f"export.tokenizer={DEMO_TOKENIZER}")
    assert not [r for r in caplog.records if r.getMessage() == NO_TOKENIZER]
    for f in DEMO_TOKENIZER.iterdir():
        assert filecmp.cmp(f, snapshot / f.name, shallow=False), f.name


def test_export_tokenizer_wins_over_the_trainers(tmp_path):
    other = tmp_path / "other-tokenizer"
    demo_tokenizer().save_pretrained(str(other))
    (other / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "marker": 1}\n')
    snapshot = _train(tmp_path, f"export.tokenizer={other}", tokenizer=demo_tokenizer())
    assert (snapshot / "tokenizer_config.json").read_text() == (other / "tokenizer_config.json").read_text()


def test_the_trainers_tokenizer_is_saved_into_each_snapshot(tmp_path):
    snapshot = _train(tmp_path, tokenizer=demo_tokenizer())
    for name in ("tokenizer.json", "tokenizer.model"):
        assert (snapshot / name).read_bytes() == (DEMO_TOKENIZER / name).read_bytes(), name


def test_a_bad_export_tokenizer_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"^export.tokenizer: '.*nowhere' is not a directory"):
        load_config(None, [f"export.tokenizer={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match=r"^export.tokenizer: is set but export.copy_tokenizer is false"):
        load_config(None, [f"export.tokenizer={DEMO_TOKENIZER}", "export.copy_tokenizer=false"])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^export.tokenizer: '.*empty' holds no tokenizer files"):
        _train(tmp_path, f"export.tokenizer={empty}")
    assert not (tmp_path / "snaps").exists()  # refused at on_train_begin, before the first step
