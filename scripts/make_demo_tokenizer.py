#!/usr/bin/env python3
"""Build the demo's tokenizer (``paddle_fullparam_callbacks/cli/demo_data/tokenizer/``) from the demo's
own text, with the `tokenizers` library (in the PaddleFormers environment):

    $(scripts/env.sh paddleformers) scripts/make_demo_tokenizer.py

A byte-level BPE of exactly 512 tokens (the tiny Llama's vocabulary): ``<pad>`` 0, ``<s>`` 1, ``</s>``
2, ``<unk>`` 3 (the ids of the tiny Llama's config), every byte, then merges learnt from
``corpus.txt``. The files are committed; this script is how they were made (training is
deterministic: the same files again).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA = Path(__file__).resolve().parents[1] / "paddle_fullparam_callbacks" / "cli" / "demo_data"
SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def main() -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=list(SPECIAL.values()), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((DATA / "corpus.txt").read_text().splitlines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1",
                                                       special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == 512, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>", "<unk>")] == [0, 1, 2, 3]
    out = DATA / "tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIAL, "model_max_length": 128,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL, indent=2) + "\n")
    print(f"wrote {sorted(p.name for p in out.iterdir())} in {out}")


if __name__ == "__main__":
    main()
