"""The bundled evaluator: perplexity of a snapshot on a text file, with transformers.

    python -m paddle_fullparam_callbacks.consumers.evaluate.perplexity SNAPSHOT [--text FILE] [--output FILE]

Runs in the evaluator's environment (torch + transformers: the ``hf`` extra), never imports
Paddle. The snapshot's own tokenizer (``AutoTokenizer``) reads the text line by line, each line
followed by the end-of-sequence token; the token stream is cut into consecutive windows of
``--window`` tokens (default: the model's ``max_position_embeddings``, at most 1024) and the
model (``AutoModelForCausalLM``, float32, on the CPU) predicts each token of a window from those
before it. The result, printed as the last line and written to ``--output``::

    {"perplexity": 41.7, "nll": 3.73, "tokens": 2310, "windows": 19, "text": "...", "seconds": 1.9}

``perplexity`` = exp(mean negative log-likelihood per predicted token). As a recipe::

    evaluate:
      command: "{python} -m paddle_fullparam_callbacks.consumers.evaluate.perplexity {snapshot} --output {output}"
      python: $PFC_HF_PYTHON          # an interpreter with torch and transformers
    retention:
      metric: evaluate.perplexity
      mode: min

The default text is the demo's held-out text (``cli/demo_data/heldout.txt``, found as a package
data file, not imported).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def default_text() -> Path:
    from importlib.resources import files

    return Path(str(files("paddle_fullparam_callbacks") / "cli" / "demo_data" / "heldout.txt"))


def token_ids(tokenizer, text: str, max_tokens: int) -> list:
    ids = []
    eos = tokenizer.eos_token_id
    for line in text.splitlines():
        if line.strip():
            ids.extend(tokenizer(line, add_special_tokens=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


def perplexity(snapshot: str, text_path: Path, window: int = 0, max_tokens: int = 200_000, threads: int = 0) -> dict:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SystemExit(f"perplexity: {e}. This evaluator needs torch and transformers (the 'hf' extra: pip install "
                         "'paddle-fullparam-callbacks[hf]' in the evaluator's environment); name that environment's "
                         "interpreter with evaluate.python") from e
    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
    model.eval()
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 1024)
    window = min(window or limit, limit, 1024)
    ids = token_ids(tokenizer, Path(text_path).read_text(encoding="utf-8"), max_tokens)
    if len(ids) < 2:
        raise SystemExit(f"perplexity: {text_path} gives {len(ids)} token(s); at least 2 are needed")
    total_nll, predicted, windows = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            if len(chunk) < 2:
                break
            inputs = torch.tensor([chunk[:-1]])
            labels = torch.tensor(chunk[1:])
            logits = model(input_ids=inputs).logits[0].float()
            nll = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            total_nll += float(nll)
            predicted += len(labels)
            windows += 1
    mean = total_nll / predicted
    return {"perplexity": math.exp(mean), "nll": mean, "tokens": predicted, "windows": windows, "window": window,
            "text": str(text_path), "seconds": round(time.perf_counter() - t0, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paddle_fullparam_callbacks.consumers.evaluate.perplexity",
                                 description="Perplexity of a Hugging Face snapshot on a text file (transformers, CPU).")
    ap.add_argument("snapshot", help="a snapshot directory (config.json, safetensors, tokenizer files)")
    ap.add_argument("--text", type=Path, default=None, help="a UTF-8 text file (default: the demo's held-out text)")
    ap.add_argument("--output", type=Path, default=None, help="write the JSON result here too")
    ap.add_argument("--window", type=int, default=0, help="tokens per window (default: the model's context, <= 1024)")
    ap.add_argument("--max-tokens", type=int, default=200_000, help="read at most this many tokens of the text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ns = ap.parse_args(argv)
    result = perplexity(ns.snapshot, ns.text or default_text(), ns.window, ns.max_tokens, ns.threads)
    text = json.dumps(result)
    if ns.output is not None:
        ns.output.write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
