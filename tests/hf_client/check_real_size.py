"""A large snapshot as transformers sees it, one tensor at a time, in the real-client environment (no Paddle):

    python check_real_size.py SNAPSHOT                              # one JSON line: the report
    python check_real_size.py FP8_SNAPSHOT --bf16 BF16_SNAPSHOT

- transformers builds the architecture of ``config.json`` on the meta device and loads the snapshot there
  (``from_pretrained(device_map="meta", output_loading_info=True)``: no tensor bytes are read, so a 15 GB
  snapshot costs nothing): its missing, unexpected and mismatched keys;
- with ``--bf16``: every float8_e4m3fn weight of FP8_SNAPSHOT against transformers' own ``Fp8Quantize`` of
  the same weight read from BF16_SNAPSHOT (the export of the same model without quantization), one weight at
  a time, so memory holds one weight: its e4m3 bytes and its ``weight_scale_inv`` must be equal, bit for
  bit; every other tensor of FP8_SNAPSHOT must equal BF16_SNAPSHOT's. A weight whose dimensions are not
  multiples of the block is padded with zeros first and cut back (``fp8_quantize.py`` says why).

Independent of the package: it reads the files with safetensors and the index, nothing else.
"""
import json
import sys
import types
import warnings
from pathlib import Path

import torch
import transformers


def _weight_map(snapshot: Path) -> dict:
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(str(snapshot / "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def meta_load(snapshot: Path) -> dict:
    config = json.loads((snapshot / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModelForCausalLM"])[0]
    cls = getattr(transformers, arch, transformers.AutoModelForCausalLM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        try:
            _, info = cls.from_pretrained(str(snapshot), device_map="meta", output_loading_info=True)
        except Exception as e:  # the refusal is the answer
            return {"architecture": arch, "error": f"{type(e).__name__}: {e}"[-2000:]}
    return {"architecture": arch, "missing": sorted(info.get("missing_keys") or []),
            "unexpected": sorted(info.get("unexpected_keys") or []),
            "mismatched": [str(k) for k in info.get("mismatched_keys") or []]}


class Reader:
    """One tensor at a time from a snapshot's files (each file opened once)."""

    def __init__(self, snapshot: Path):
        from safetensors import safe_open

        self.map = _weight_map(snapshot)
        self._files = {f: safe_open(str(snapshot / f), framework="pt") for f in sorted(set(self.map.values()))}

    def get(self, name: str) -> torch.Tensor:
        return self._files[self.map[name]].get_tensor(name)


def _quantize(weight: torch.Tensor, block) -> tuple:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    rows, cols = weight.shape
    padded = weight
    if rows % block[0] or cols % block[1]:
        padded = torch.zeros((-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]), dtype=weight.dtype)
        padded[:rows, :cols] = weight
    rule = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=tuple(block))))
    res = rule.convert({"w.weight": padded})
    return res["w.weight"][:rows, :cols], res["w.weight_scale_inv"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (a NaN equals itself)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def fp8_against_bf16(fp8: Path, bf16: Path) -> dict:
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    q, plain = Reader(fp8), Reader(bf16)
    scales = {n for n in q.map if n.endswith("_scale_inv")}
    quantized, other, wrong = 0, 0, []
    for name in sorted(q.map):
        if name in scales:
            continue
        got = q.get(name)
        if got.dtype == torch.float8_e4m3fn:
            want, want_inv = _quantize(plain.get(name), block)
            quantized += 1
            if not _same(got, want):
                wrong.append(f"{name}: e4m3 bytes")
            if name + "_scale_inv" not in scales or not _same(q.get(name + "_scale_inv"), want_inv):
                wrong.append(f"{name}_scale_inv")
        else:
            other += 1
            if name not in plain.map or not _same(got, plain.get(name)):
                wrong.append(f"{name}: differs from the bfloat16 snapshot's")
        del got
    orphans = sorted(s for s in scales if s[:-len("_scale_inv")] not in q.map)
    return {"quantized_weights": quantized, "other_tensors": other, "wrong": wrong[:20], "wrong_count": len(wrong),
            "orphan_scales": orphans, "block": block}


def main():
    args = sys.argv[1:]
    bf16 = None
    if "--bf16" in args:
        i = args.index("--bf16")
        bf16 = Path(args[i + 1])
        del args[i:i + 2]
    snapshot = Path(args[0])
    report = {"snapshot": str(snapshot), "tensors": len(_weight_map(snapshot)), "meta": meta_load(snapshot)}
    if bf16 is not None:
        report["fp8"] = fp8_against_bf16(snapshot, bf16)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
