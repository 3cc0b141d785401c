"""Write a tiny Llama (random weights, the demo's 512-token SentencePiece tokenizer) to a local directory,
for the CPU examples and tests of ``paddle-fullparam run``: a model directory as the frameworks' entry
points expect one (``config.json``, weights, tokenizer files).

    python examples/make_tiny_llama.py DIR                          # PaddleFormers (paddleformers-cli train)
    python examples/make_tiny_llama.py DIR --framework paddlenlp    # PaddleNLP (its LlamaTokenizer's files)

PaddleFormers reads the tokenizer as a Llama repository on the hub holds it (``tokenizer.model``,
``tokenizer.json``); PaddleNLP 2.8's ``LlamaTokenizer`` reads the same SentencePiece model under the name
``sentencepiece.bpe.model``. About 0.5 MB; a few seconds.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER, make_tiny_llama


def write_paddlenlp_tokenizer(out: Path) -> None:
    shutil.copy(DEMO_TOKENIZER / "tokenizer.model", out / "sentencepiece.bpe.model")
    shutil.copy(DEMO_TOKENIZER / "tokenizer_config.json", out / "tokenizer_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--framework", choices=("paddleformers", "paddlenlp"), default="paddleformers")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_llama(ns.framework, seed=ns.seed, tie_word_embeddings=False)
    model.save_pretrained(str(ns.out))
    if ns.framework == "paddleformers":
        for f in DEMO_TOKENIZER.iterdir():
            shutil.copy(f, ns.out / f.name)
    else:
        write_paddlenlp_tokenizer(ns.out)
    for stray in ns.out.glob("saved_signal_*"):  # PaddleFormers' saver leaves one per rank
        stray.unlink()
    print(f"tiny Llama ({ns.framework}) in {ns.out}: {', '.join(sorted(p.name for p in ns.out.iterdir()))}")


if __name__ == "__main__":
    main()
