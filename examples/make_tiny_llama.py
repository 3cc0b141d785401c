"""Write a tiny Llama (random weights, a 512-token byte-level BPE tokenizer) to a local directory, for the
CPU examples and tests of ``paddle-fullparam run``: a model directory as the frameworks' entry points
expect one (``config.json``, weights, tokenizer files).

    python examples/make_tiny_llama.py DIR                          # PaddleFormers (paddleformers-cli train)
    python examples/make_tiny_llama.py DIR --framework paddlenlp    # PaddleNLP (its GPTTokenizer files)

PaddleFormers reads the tokenizer as the Hugging Face hub writes it (``tokenizer.json``); PaddleNLP 2.8
cannot, so for it the same BPE is written as ``vocab.json`` + ``merges.txt`` (what its ``GPTTokenizer``
reads). About 0.5 MB; a few seconds.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER, make_tiny_llama


def write_paddlenlp_tokenizer(out: Path) -> None:
    hub = json.loads((DEMO_TOKENIZER / "tokenizer.json").read_text())
    (out / "vocab.json").write_text(json.dumps(hub["model"]["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in hub["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    special = json.loads((DEMO_TOKENIZER / "special_tokens_map.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPTTokenizer", **special,
                                                           "model_max_length": 128}))


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
