"""llama.cpp's own ``convert_hf_to_gguf.py`` run on a Llama snapshot, and the GGUF it writes read back, in the
real-client environment (torch, transformers, sentencepiece, gguf; no Paddle):

    python convert_gguf.py CONVERTER SNAPSHOT OUT.gguf TEXT_FILE [...]    # one JSON line: the report

- the converter runs as a person runs it, ``python convert_hf_to_gguf.py SNAPSHOT --outfile OUT.gguf
  --outtype f32`` (f32: float32 weights are written as they are); its exit code and output are reported;
- every tensor of the GGUF (read with the gguf package's ``GGUFReader``) against the snapshot's tensor of
  the same weight (llama.cpp's names for a Llama: the table below), bit for bit (an FP8 snapshot's weights
  dequantized by the layout, which the converter does itself); the attention's q and k
  rows after undoing the permutation the converter documents for Llama (llama.cpp's rotary embedding
  rotates neighbouring rows of a head, Hugging Face's the two halves of it);
- the tokenizer metadata against the snapshot's ``tokenizer.model`` read with sentencepiece: every piece,
  score and type, the special ids;
- transformers' ``AutoTokenizer`` of the snapshot encodes each line of the text files as sentencepiece does.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
# beyond the demo's text: characters it never saw (byte fallback), digits, runs of spaces
EXTRA = ["Zürich, 2024: ☃ — naïve café", "two  spaces   and three", "x=3.14159; y = 42"]


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<rest>
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER[module]}.{suffix}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from llama.cpp's order (row pairs interleaved) back to Hugging Face's (halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def snapshot_tensors(path: Path) -> dict:
    """Every weight of the snapshot as the float32 values the converter must write with ``--outtype f32``:
    float32 as stored, bfloat16 widened, an FP8 weight dequantized by the layout (e4m3 value times its block's
    ``weight_scale_inv``, partial edge blocks included; the scales themselves are no weights)."""
    import torch
    from safetensors.torch import load_file

    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        raw.update(load_file(str(f)))
    config = json.loads((path / "config.json").read_text())
    block = (config.get("quantization_config") or {}).get("weight_block_size")
    out = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = raw[name + "_scale_inv"].repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            t = t.to(torch.float32) * scale[:t.shape[0], :t.shape[1]]
        out[name] = t.to(torch.float32).numpy()
    return out


def check_tensors(reader, snapshot: Path, config: dict) -> dict:
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    got = {t.name: np.asarray(t.data) for t in reader.tensors}
    want = {gguf_name(k): v for k, v in snapshot_tensors(snapshot).items()}
    unequal, permuted = [], []
    for name in sorted(set(got) & set(want)):
        g, w = got[name], want[name]
        kind = name.split(".")[-2]
        if kind in heads:
            if g.shape == w.shape and not np.array_equal(g, w):
                permuted.append(name)  # as written: not the snapshot's row order
            g = unpermute(g, heads[kind])
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
            unequal.append(f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
    return {"tensors": len(got), "gguf_only": sorted(set(got) - set(want)), "snapshot_only": sorted(set(want) - set(got)),
            "unequal": unequal, "permuted": permuted}


def check_vocab(reader, snapshot: Path) -> dict:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(snapshot / "tokenizer.model"))
    field = {k: f.contents() for k, f in reader.fields.items() if k.startswith(("tokenizer.", "general.arch"))}
    n = sp.vocab_size()

    def kind(i):  # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    return {
        "architecture": field.get("general.architecture"), "model": field.get("tokenizer.ggml.model"),
        "tokens": len(field.get("tokenizer.ggml.tokens", [])), "sentencepiece_vocab": n,
        "pieces_equal": field.get("tokenizer.ggml.tokens") == [sp.id_to_piece(i) for i in range(n)],
        "scores_equal": np.array_equal(np.asarray(field.get("tokenizer.ggml.scores"), np.float32),
                                       np.asarray([sp.get_score(i) for i in range(n)], np.float32)),
        "types_equal": field.get("tokenizer.ggml.token_type") == [kind(i) for i in range(n)],
        "special": {k: field.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")},
    }


def check_transformers(snapshot: Path, texts: list) -> dict:
    import sentencepiece
    import transformers

    sp = sentencepiece.SentencePieceProcessor(model_file=str(snapshot / "tokenizer.model"))
    tok = transformers.AutoTokenizer.from_pretrained(str(snapshot))
    lines = [line for f in texts for line in Path(f).read_text().splitlines() if line.strip()] + EXTRA
    differ = [line for line in lines if tok(line)["input_ids"] != [sp.bos_id(), *sp.encode(line)]]
    return {"class": type(tok).__name__, "lines": len(lines), "differ": differ}


def main():
    converter, snapshot, out, *texts = sys.argv[1:]
    snapshot = Path(snapshot)
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, converter, str(snapshot), "--outfile", out, "--outtype", "f32"],
                         capture_output=True, text=True)
    report = {"returncode": run.returncode, "output": run.stdout + run.stderr,
              "convert_s": round(time.perf_counter() - t0, 2)}
    if run.returncode == 0:
        from gguf import GGUFReader

        reader = GGUFReader(out)
        config = json.loads((snapshot / "config.json").read_text())
        report.update(check_tensors(reader, snapshot, config), vocab=check_vocab(reader, snapshot))
    report["transformers"] = check_transformers(snapshot, texts)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
