"""Snapshots carry a tokenizer, or the job says at start that they will not: the trainer's tokenizer,
``export.tokenizer``'s files, the demo's real tokenizer; tried with transformers (tokenizer, model,
``generate``) and with llama.cpp's gguf package (what its converter checks of its input)."""
from __future__ import annotations

import filecmp
import logging

import pytest

pytestmark = [pytest.mark.paddleformers, pytest.mark.hf_client]

from paddle_fullparam_callbacks import FullParamExportCallback  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import (  # noqa: E402
    DEMO_TOKENIZER, demo_tokenizer, make_tiny_llama, make_trainer, run_demo, trainer_args,
)
from paddle_fullparam_callbacks.config import ConfigError, load_config  # noqa: E402
from paddle_fullparam_callbacks.models.tokenizer import NO_TOKENIZER  # noqa: E402

from _helpers import use_snapshots  # noqa: E402


def _train(tmp_path, *overrides, tokenizer=None, steps=2):
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 'snaps'}", "trigger.on_train_end=true",
                                                  *overrides])
    args = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, save_steps=1000)
    make_trainer("paddleformers", make_tiny_llama(seed=1), args, [cb], tokenizer=tokenizer).train()
    assert cb.errors == [] and cb.snapshots
    return cb.snapshots[-1].path


def test_demo_snapshots_load_with_their_tokenizer_and_generate_text(tmp_path, hf_python):
    assert run_demo(str(tmp_path / "demo"), steps=8, overrides=["trigger.every_n_steps=4"]) == 0
    snapshot = tmp_path / "demo" / "snapshots" / "hf-step-000008"
    assert (snapshot / "tokenizer.json").is_file() and (snapshot / "tokenizer_config.json").is_file()
    report = use_snapshots(hf_python, snapshot)[str(snapshot)]
    hf, gg = report["transformers"], report["gguf"]
    assert "error" not in hf, hf
    assert hf["vocab"] == 512 and hf["missing_keys"] == hf["unexpected_keys"] == hf["mismatched_keys"] == []
    tok = demo_tokenizer()  # the same ids on both sides: the tokenizer travelled unchanged
    assert hf["prompt_ids"] == tok("The river town")["input_ids"]
    assert len(hf["generated_ids"]) == 8 and hf["text"].strip(), hf
    assert gg["vocab_size"] == 512 and gg["special_tokens"] == {"bos": 1, "eos": 2, "unk": 3, "pad": 0}, gg
    assert gg["gguf_arch"] == "LLAMA" and gg["unmapped"] == [] and gg["tensors"] == 21 and gg["merges"] == 252


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
    assert (snapshot / "tokenizer.json").read_bytes() == (DEMO_TOKENIZER / "tokenizer.json").read_bytes()


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
