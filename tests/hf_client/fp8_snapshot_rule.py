"""An FP8 snapshot against transformers' own ``Fp8Quantize`` of the plain snapshot, byte for byte (no Paddle).

    python fp8_snapshot_rule.py FP8_SNAPSHOT PLAIN_SNAPSHOT [--only NAME]     # one JSON line: the report

``PLAIN_SNAPSHOT`` is the same export without ``export.quantization``. One weight at a time (memory: a few of
the largest weight's size): every ``float8_e4m3fn`` tensor of the FP8 snapshot (``--only``: that one alone) is
compared with what transformers' ``Fp8Quantize`` (the block of ``config.json``'s ``quantization_config``) makes of
the tensor of the same name in the plain snapshot: the e4m3 bytes and the ``weight_scale_inv`` bits, exactly. Every
other tensor must be the plain snapshot's, byte for byte; every tensor of the plain snapshot must be in the FP8 one
(quantized or not). A dimension that is not a multiple of the block is padded with zeros first and cut back, as
``fp8_quantize.py`` does (transformers passes such a weight through unquantized; a zero never changes a block's
``max_abs``).

Reported per quantized weight: its shape, the bytes and the scales that differ from the rule, and the first few
differing elements (row, column, byte, the rule's byte); ``others_differing``: the other tensors that are not the
plain snapshot's; ``missing`` / ``extra``: tensors of one snapshot without their counterpart.
"""
import json
import sys
import time
import types
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config

EXAMPLES = 5


def index(snapshot: Path) -> dict:
    """name -> file of every tensor of ``snapshot``."""
    out = {}
    for f in sorted(snapshot.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def tensor(files: dict, name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as h:
        return h.get_tensor(name)


def rule(weight: torch.Tensor, block) -> tuple:
    """(e4m3 bytes as uint8, weight_scale_inv) of ``weight`` by transformers' ``Fp8Quantize``."""
    rows, cols = weight.shape
    padded = weight
    if rows % block[0] or cols % block[1]:
        padded = torch.zeros((-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]), dtype=weight.dtype)
        padded[:rows, :cols] = weight
    quantizer = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
    res = quantizer.convert({"w.weight": padded})
    return res["w.weight"].view(torch.uint8)[:rows, :cols], res["w.weight_scale_inv"]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def main():
    fp8, plain = Path(sys.argv[1]), Path(sys.argv[2])
    only = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--only" else None
    t0 = time.perf_counter()
    block = tuple(json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"])
    q_files, p_files = index(fp8), index(plain)
    quantized, others_differing, others = {}, [], 0
    for name in sorted(q_files):
        if name.endswith("_scale_inv") or (only is not None and name != only):
            continue
        got = tensor(q_files, name)
        if got.dtype != torch.float8_e4m3fn:
            others += 1
            if name not in p_files or not torch.equal(raw(got), raw(tensor(p_files, name))):
                others_differing.append(name)
            continue
        want_q, want_inv = rule(tensor(p_files, name), block)
        got_q, got_inv = got.view(torch.uint8), tensor(q_files, name + "_scale_inv")
        differ = got_q != want_q
        where = differ.nonzero()[:EXAMPLES].tolist()
        same_shape = tuple(got_inv.shape) == tuple(want_inv.shape)
        quantized[name] = {
            "shape": list(got.shape), "elements": got.numel(), "differing_bytes": int(differ.sum()),
            "differing_scales": int((got_inv.view(torch.int32) != want_inv.view(torch.int32)).sum()) if same_shape
            else -1, "scale_shape": list(got_inv.shape),
            "examples": [[r, c, int(got_q[r, c]), int(want_q[r, c])] for r, c in where],
        }
        del got, got_q, want_q
    scales = {n for n in q_files if n.endswith("_scale_inv")}
    print(json.dumps({
        "block": list(block), "quantized": quantized, "others_compared": others, "others_differing": others_differing,
        "missing": sorted(set(p_files) - set(q_files)) if only is None else [],
        "extra": [] if only is not None else sorted(
            n for n in set(q_files) - set(p_files) if n not in scales or n[:-len("_scale_inv")] not in q_files),
        "seconds": round(time.perf_counter() - t0, 2),
    }))


if __name__ == "__main__":
    main()
