"""A snapshot used as people use one, in the real-client environment (no Paddle):

    python use_snapshot.py SNAPSHOT [SNAPSHOT ...]      # one JSON line: snapshot -> report

- transformers: ``AutoTokenizer.from_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` as
  written (loading info: missing, unexpected, mismatched keys), then greedy ``generate`` of a few
  tokens from a prompt, decoded back to text;
- gguf (llama.cpp's Python package, which its ``convert_hf_to_gguf.py`` uses): the checks that
  converter makes of its input before converting: the vocabulary read from the tokenizer files as
  its Llama-family models read it (``SentencePieceVocab`` from ``tokenizer.model``, else ``BpeVocab``
  from a byte-level BPE's ``tokenizer.json``; without tokenizer files it stops, as the converter does),
  the special tokens and merges (``SpecialVocab``), and every tensor name mapped to its GGUF name
  (``TensorNameMap``) for the architectures llama.cpp converts name by name.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = "The river town"
NEW_TOKENS = 8

# config.json architecture -> llama.cpp architecture whose tensors convert_hf_to_gguf.py maps one by
# one (MoE experts, fused tensors, Bloom's "transformer." prefix and other rewrites are done by the
# converter's model classes first: those architectures are not checked name by name here)
GGUF_ARCH = {
    "LlamaForCausalLM": "LLAMA", "Qwen2ForCausalLM": "QWEN2", "Qwen3ForCausalLM": "QWEN3", "Phi3ForCausalLM": "PHI3",
    "Gemma3ForCausalLM": "GEMMA3", "GPT2LMHeadModel": "GPT2", "GPTJForCausalLM": "GPTJ",
    "Ernie4_5ForCausalLM": "ERNIE4_5",
}


def use_with_transformers(snapshot: str) -> dict:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(snapshot)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(snapshot, output_loading_info=True,
                                                                    dtype=torch.float32)
    model.eval()
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    return {
        "tokenizer": type(tok).__name__, "vocab": len(tok), "prompt_ids": enc["input_ids"][0].tolist(),
        "generated_ids": new, "text": tok.decode(new, skip_special_tokens=True), "class": type(model).__name__,
        "missing_keys": sorted(info.get("missing_keys", [])), "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
    }


def gguf_input_checks(snapshot: str) -> dict:
    import gguf
    from gguf import vocab

    path = Path(snapshot)
    config = json.loads((path / "config.json").read_text())
    out = {}
    for kind in (vocab.SentencePieceVocab, vocab.BpeVocab):
        try:
            read = kind(path)
        except Exception as e:  # what the converter would die of, when neither reads
            out["vocab_error"] = f"{type(e).__name__}: {e}"
        else:
            out.update(vocab_size=read.vocab_size, vocab_model=read.tokenizer_model)
            out.pop("vocab_error", None)
            break
    special = vocab.SpecialVocab(path, load_merges=True, n_vocab=config.get("vocab_size"))
    out["special_tokens"] = special.special_token_ids
    out["merges"] = len(special.merges)
    arch = GGUF_ARCH.get((config.get("architectures") or [None])[0])
    if arch is not None:
        blocks = config.get("num_hidden_layers") or config.get("n_layer")
        names = tensor_names(path)
        tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), blocks)
        out["gguf_arch"] = arch
        out["unmapped"] = [n for n in names if tmap.get_name(n, try_suffixes=(".weight", ".bias")) is None]
        out["tensors"] = len(names)
    return out


def tensor_names(path: Path) -> list:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "np") as f:
        return sorted(f.keys())


def main():
    report = {}
    for snapshot in sys.argv[1:]:
        entry = {}
        for key, fn in (("transformers", use_with_transformers), ("gguf", gguf_input_checks)):
            try:
                entry[key] = fn(snapshot)
            except Exception as e:  # reported, the test decides
                entry[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report[snapshot] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
