"""Run in the real-client environment (torch + transformers + peft, no Paddle).

    python check_lora.py CASES.json

CASES.json: a list of {"merged": SNAPSHOT, "ids": IDS.npy, "logits": LOGITS.npy (the Paddle LoRA
model's forward) or absent, "base": SNAPSHOT of the base weights (the negative control: its logits
must differ) or null, "adapter": DIR (adapter_model.safetensors + adapter_config.json) or null,
"dtype": the dtype peft loads the base in}. Prints one JSON line: a list of reports (merged
snapshot: missing/unexpected keys, logits difference to Paddle's and to the base weights'; with a base
and an adapter: peft's load (missing adapter keys, unexpected), the peft model's logits, which merged
tensors differ, bit for bit, from the package's rule applied to peft's own layers (``rule_differ``:
float32 ``W + round32(exact sum of B @ A) * float32(s)``, computed here with ``math.fsum``, independently of
the package), and how far ``merge_and_unload()``'s tensors are from the snapshot's, in units of the
rounding torch's float32 matmul may make (``vs_peft_merge``: at most 1 when it is only that rounding)).
"""
import json
import math
import sys
from fractions import Fraction

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


def _nearest_f32(s64: float, terms) -> float:
    """The float32 nearest the exact sum of ``terms``, given ``s64``, the float64 nearest it (math.fsum):
    casting s64 rounds twice, which is wrong only when s64 sits exactly on a float32 tie."""
    f = np.float32(s64)
    other = np.nextafter(f, np.float32(math.copysign(np.inf, s64 - float(f))))
    if float(f) == s64 or s64 != (float(f) + float(other)) / 2:
        return float(f)
    exact = sum((Fraction(t) for t in terms), Fraction(0))  # a float64 tie: settle it with the exact sum
    lo, hi = sorted((float(f), float(other)))
    mid = (Fraction(lo) + Fraction(hi)) / 2
    if exact != mid:
        return hi if exact > mid else lo
    even = [c for c in (lo, hi) if int(np.array(c, np.float32).view(np.uint32)) & 1 == 0]
    return even[0]


def _rule_product(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """lora_B.weight [out, r] @ lora_A.weight [r, in] by the rule, element by element (math.fsum of the exact
    float64 products: the float64 nearest the exact sum)."""
    b64, a64 = b.astype(np.float64), a.astype(np.float64)
    out = np.empty((b.shape[0], a.shape[1]), np.float32)
    for i in range(b.shape[0]):
        prods = b64[i][:, None] * a64  # [r, in]: exact
        for j in range(a.shape[1]):
            terms = prods[:, j].tolist()
            out[i, j] = _nearest_f32(math.fsum(terms), terms)
    out[out == 0] = 0.0
    return out


def _rule_and_bound(pm, adapter_name="default"):
    """{module name: (rule's merged float32 weight, the matmul rounding's bound)} from peft's LoRA layers."""
    import peft

    out = {}
    for name, mod in pm.named_modules():
        if not isinstance(mod, peft.tuners.lora.LoraLayer) or adapter_name not in mod.lora_A:
            continue
        w = mod.get_base_layer().weight.detach().float().numpy()
        a = mod.lora_A[adapter_name].weight.detach().float().numpy()
        b = mod.lora_B[adapter_name].weight.detach().float().numpy()
        s = np.float32(mod.scaling[adapter_name])
        merged = w + _rule_product(b, a) * s
        bound = (a.shape[0] + 4) * 2.0 ** -23 * (abs(float(s)) * (np.abs(b) @ np.abs(a)) + np.abs(w))
        key = name.replace("base_model.model.", "", 1) + ".weight"
        out[key] = (merged, bound)
    return out


def _ulp(x: torch.Tensor) -> np.ndarray:
    """One unit in the last place of each value in its own dtype (0 for float32: compared there directly)."""
    if x.dtype == torch.float32:
        return np.zeros(tuple(x.shape))
    bits = {torch.bfloat16: 8, torch.float16: 11}[x.dtype]
    v = np.abs(x.float().numpy()).astype(np.float64)
    return np.ldexp(1.0, np.frexp(np.maximum(v, 1e-30))[1] - bits)


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
        rule = _rule_and_bound(pm)
        merged = pm.merge_and_unload().state_dict()
        snap = _snapshot_state(case["merged"])
        rule_differ = sorted(k for k, (want, _) in rule.items()
                             if not torch.equal(torch.from_numpy(want).to(snap[k].dtype), snap[k]))
        # peft's merge: its float32 matmul's rounding (the bound), then the snapshot dtype's own rounding (1 ulp)
        ratios = [float(np.max(np.abs(merged[k].to(snap[k].dtype).float().numpy() - snap[k].float().numpy())
                               / (bound + _ulp(snap[k]) + 1e-45))) for k, (_, bound) in rule.items()]
        report["rule"] = {"tensors": len(rule), "rule_differ": rule_differ}
        report["vs_peft_merge"] = {"tensors": len(ratios), "max_ratio_to_bound": max(ratios or [0.0]),
                                   "bitwise_equal": sum(torch.equal(merged[k].to(snap[k].dtype), snap[k]) for k in rule)}
    return report


def main():
    cases = json.load(open(sys.argv[1]))
    print(json.dumps([check(c) for c in cases]))


if __name__ == "__main__":
    main()
