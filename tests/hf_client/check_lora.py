"""Run in the real-client environment (torch + transformers + peft, no Paddle).

    python check_lora.py CASES.json

CASES.json: a list of {"merged": SNAPSHOT, "ids": IDS.npy, "logits": LOGITS.npy (the Paddle LoRA
model's forward) or absent, "base": SNAPSHOT of the base weights (the negative control: its logits
must differ) or null, "adapter": DIR (adapter_model.safetensors + adapter_config.json) or null,
"dtype": the dtype peft loads the base in}. Prints one JSON line: a list of reports (merged
snapshot: missing/unexpected keys, logits difference to Paddle's and to the base weights'; with a base
and an adapter: peft's load (missing adapter keys, unexpected), the peft model's logits, and which
merged tensors of ``merge_and_unload()`` differ from the snapshot's, bit for bit).
"""
import json
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def _snapshot_state(path):
    from pathlib import Path

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check(case):
    ids = torch.from_numpy(np.load(case["ids"]).astype("int64"))
    expected = np.load(case["logits"]) if case.get("logits") else None
    model, info = transformers.AutoModelForCausalLM.from_pretrained(case["merged"], output_loading_info=True,
                                                                    dtype=torch.float32)
    model.eval()
    got = _logits(model, ids)
    report = {
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
    }
    if expected is not None:
        report["merged_max_abs_diff"] = float(np.max(np.abs(got - expected)))
    if case.get("base"):  # the negative control: the base weights' logits
        base = transformers.AutoModelForCausalLM.from_pretrained(case["base"], dtype=torch.float32)
        base.eval()
        report["vs_base_logits"] = float(np.max(np.abs(got - _logits(base, ids))))
    if case.get("adapter") and case.get("base"):
        import peft
        from peft.utils import set_peft_model_state_dict

        dtype = getattr(torch, case.get("dtype", "float32"))
        base = transformers.AutoModelForCausalLM.from_pretrained(case["base"], dtype=dtype)
        pm = peft.PeftModel.from_pretrained(base, case["adapter"])
        pm.eval()
        adapter_sd = load_file(case["adapter"] + "/adapter_model.safetensors")
        result = set_peft_model_state_dict(pm, adapter_sd)
        report["peft_missing_adapter_keys"] = sorted(k for k in result.missing_keys if "lora_" in k)
        report["peft_unexpected_keys"] = sorted(result.unexpected_keys)
        report["peft_modules"] = sum(1 for _, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))
        report["peft_adapter_tensors"] = len(adapter_sd)
        if dtype == torch.float32 and expected is not None:
            report["peft_max_abs_diff"] = float(np.max(np.abs(_logits(pm, ids) - expected)))
        merged = pm.merge_and_unload().state_dict()
        snap = _snapshot_state(case["merged"])
        differ = sorted(k for k in snap if k in merged and not torch.equal(merged[k].to(snap[k].dtype), snap[k]))
        report["bitwise_vs_peft_merge"] = {"tensors": len(snap), "differ": differ,
                                          "max_abs": max([float((merged[k].float() - snap[k].float()).abs().max())
                                                          for k in differ] or [0.0])}
    return report


def main():
    cases = json.load(open(sys.argv[1]))
    print(json.dumps([check(c) for c in cases]))


if __name__ == "__main__":
    main()
