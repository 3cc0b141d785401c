"""An FP8 snapshot as transformers reads it, in the real-client environment (no Paddle):

    python check_fp8.py FP8_SNAPSHOT PLAIN_SNAPSHOT INPUT_IDS.npy      # one JSON line: the report

``PLAIN_SNAPSHOT`` is the same export without ``export.quantization``. transformers loads the FP8 snapshot
as a user would (``AutoModelForCausalLM.from_pretrained``, float32; on a CPU it dequantizes, with
``accelerate``). Reported: the loading info; the logits against those of the plain snapshot with each
quantized weight replaced by its dequantized value (the layout's: e4m3 value times its block's
``weight_scale_inv``, partial edge blocks included, computed here) and against the plain snapshot's own;
and, per quantized weight, how far the weight transformers loaded is from the layout's dequantized one
(transformers 5.x misreads a dimension that is not a multiple of the block: ``plan/quantization.py``); a
snapshot transformers refuses to load gives ``load_error`` instead.
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file


def tensors(snapshot: Path) -> dict:
    out = {}
    for f in sorted(snapshot.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def logits(snapshot, ids):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(snapshot), dtype=torch.float32,
                                                                    output_loading_info=True)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float(), model, info


def main():
    fp8, plain = Path(sys.argv[1]), Path(sys.argv[2])
    ids = torch.from_numpy(np.load(sys.argv[3]).astype("int64"))
    q, p = tensors(fp8), tensors(plain)
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    dequantized = {}
    for name, t in q.items():
        if t.dtype == torch.float8_e4m3fn:
            s = q[name + "_scale_inv"].repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            dequantized[name] = t.to(torch.float32) * s[:t.shape[0], :t.shape[1]]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for f in plain.iterdir():
            if f.name in ("config.json", "generation_config.json"):
                (d / f.name).write_bytes(f.read_bytes())
        save_file({k: (dequantized.get(k, v)).contiguous() for k, v in p.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        want, _, _ = logits(d, ids)
    base, _, _ = logits(plain, ids)
    try:
        got, model, info = logits(fp8, ids)
    except Exception as e:  # transformers refuses some layouts it cannot cut into its blocks: reported
        print(json.dumps({"load_error": f"{type(e).__name__}: {e}"[-3000:], "quantized": len(dequantized)}))
        return
    state = model.state_dict()
    misread = {k: float((state[k].float() - v).abs().max()) for k, v in dequantized.items() if k in state}
    print(json.dumps({
        "class": type(model).__name__, "quantized": len(dequantized),
        "missing_keys": sorted(info.get("missing_keys", [])), "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
        "dequantized_logits_diff": float((got - want).abs().max()), "plain_logits_diff": float((got - base).abs().max()),
        "logits_absmax": float(base.abs().max()), "weights_misread": {k: v for k, v in misread.items() if v},
        "weights_compared": len(misread),
    }))


if __name__ == "__main__":
    main()
