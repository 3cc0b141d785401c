#!/usr/bin/env python3
"""Train the demo's tokenizer (``paddle_fullparam_callbacks/cli/demo_data/tokenizer/``) from the demo's
own text, as Llama tokenizers are made: a SentencePiece BPE model. In the PaddleFormers environment
(it has ``sentencepiece``, ``transformers`` and ``protobuf``):

    $(scripts/env.sh paddleformers) scripts/train_demo_tokenizer.py

Exactly 512 tokens (the tiny Llama's vocabulary): ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3 (the
ids of the tiny Llama's config), the 256 byte pieces (byte fallback: any text encodes), then the
pieces learnt from ``corpus.txt``; Llama 2's normalization (none, a dummy prefix, digits split).

Three files, the ones a Llama repository on the hub holds:

* ``tokenizer.model``: the SentencePiece model (what llama.cpp's ``convert_hf_to_gguf.py`` and
  PaddleNLP's ``LlamaTokenizer`` read);
* ``tokenizer.json``: the same tokenizer as transformers' ``LlamaTokenizer`` converts it (what
  transformers and PaddleFormers read; PaddleFormers 1.2 converts ``tokenizer.model`` alone into a
  tokenizer without the dummy prefix, so the converted one is shipped);
* ``tokenizer_config.json``: the class and the special tokens.

The files are committed; this script is how they were made. Training is deterministic (one thread):
sentencepiece 0.2.3 and transformers 5.3.0 wrote the committed files, and run again write them again.
It checks that ``tokenizer.json`` encodes the demo's text as the SentencePiece model does (text that
starts with a space is the one known difference of every converted Llama tokenizer: SentencePiece adds
its dummy prefix to it, transformers' Metaspace does not).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import sentencepiece as spm

DATA = Path(__file__).resolve().parents[1] / "paddle_fullparam_callbacks" / "cli" / "demo_data"
SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
CONFIG = {"tokenizer_class": "LlamaTokenizer", **{f"{k}_token": v for k, v in SPECIAL.items()},
          "add_bos_token": True, "add_eos_token": False, "model_max_length": 128,
          "clean_up_tokenization_spaces": False}


def train_model() -> bytes:
    lines = [line for line in (DATA / "corpus.txt").read_text().splitlines() if line.strip()]
    out = tempfile.SpooledTemporaryFile()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, model_type="bpe", vocab_size=512,
        character_coverage=1.0, byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        **{f"{k}_id": i for i, k in enumerate(SPECIAL)}, **{f"{k}_piece": v for k, v in SPECIAL.items()},
        num_threads=1, minloglevel=2)
    out.seek(0)
    return out.read()


def main() -> None:
    from transformers import AutoTokenizer

    out = DATA / "tokenizer"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    (out / "tokenizer.model").write_bytes(train_model())
    (out / "tokenizer_config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    with tempfile.TemporaryDirectory() as tmp:  # transformers' conversion of tokenizer.model alone
        shutil.copy(out / "tokenizer.model", tmp)
        shutil.copy(out / "tokenizer_config.json", tmp)
        converted = AutoTokenizer.from_pretrained(tmp)
        converted.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "tokenizer.json", out / "tokenizer.json")

    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.vocab_size() == 512, sp.vocab_size()
    assert [sp.piece_to_id(p) for p in SPECIAL.values()] == [0, 1, 2, 3]
    shipped = AutoTokenizer.from_pretrained(str(out))
    text = [*(DATA / "corpus.txt").read_text().splitlines(), *(DATA / "heldout.txt").read_text().splitlines(),
            "Zürich, 2024: ☃  two  spaces"]
    for line in text:
        assert shipped(line)["input_ids"] == [1, *sp.encode(line)], line
    print(f"wrote {sorted(p.name for p in out.iterdir())} in {out}")


if __name__ == "__main__":
    main()
