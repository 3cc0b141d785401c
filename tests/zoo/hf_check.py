"""The transformers half of the model zoo, one process in the ``hf`` environment (no Paddle).

    python tests/zoo/hf_check.py RESULTS_JSON [RESULTS_JSON ...]

For each case ``run_zoo.py`` recorded: ``verify --transformers`` (the package's own check:
transformers' loader on the meta device; missing, unexpected, mis-shaped, mis-typed tensors); the
snapshot used as people use one (its tokenizer, the model, ``generate``; llama.cpp's gguf package's
input checks: ``hf_client/use_snapshot.py``); then, where Paddle's forward ran, its logits compared
with Paddle's. Prints one JSON object: case id -> report.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from paddle_fullparam_callbacks.export.verify.hf import verify_with_transformers  # noqa: E402
import fp8_zoo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf_client"))
from use_snapshot import gguf_input_checks, use_with_transformers  # noqa: E402


def check(entry: dict) -> dict:
    out = {}
    if "refused_error" in entry:
        return {}
    snapshot = entry.get("snapshot")
    if not snapshot:
        return {"error": "no snapshot"}
    out["verify"] = verify_with_transformers(snapshot).as_dict()
    if (entry.get("fp8") or {}).get("snapshot"):  # the FP8 export of the same model (fp8_zoo.py)
        try:
            out["fp8"] = fp8_zoo.hf_check(entry)
        except Exception as e:  # reported per case; the test names it
            out["fp8"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if entry.get("multimodal"):  # image-text-to-text: hf_mm.py loads and compares it
        import hf_mm

        out.update(hf_mm.check(entry))
        return out
    for key, fn in (("use", use_with_transformers), ("gguf", gguf_input_checks)):  # as people use a snapshot
        try:
            out[key] = fn(snapshot)
        except Exception as e:  # reported per case; the test names it
            out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if entry.get("forward") and entry.get("logits"):
        model = transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
        model.eval()
        ids = torch.from_numpy(np.load(entry["ids"]).astype("int64"))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().numpy()
        expected = np.load(entry["logits"])
        out["class"] = type(model).__name__
        out["max_abs_diff"] = float(np.max(np.abs(logits - expected))) if logits.shape == expected.shape else None
        out["shape"] = [list(logits.shape), list(expected.shape)]
    return out


def main():
    report = {}
    for path in sys.argv[1:]:
        for entry in json.loads(Path(path).read_text()):
            try:
                report[entry["id"]] = check(entry)
            except Exception as e:  # reported per case; the test names it
                report[entry["id"]] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
