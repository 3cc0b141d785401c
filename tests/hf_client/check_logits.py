"""Run in the real-client environment (torch + transformers, no Paddle).

    python check_logits.py SNAPSHOT_DIR INPUT_IDS.npy EXPECTED_LOGITS.npy

Loads the snapshot with ``transformers.AutoModelForCausalLM.from_pretrained`` exactly as a user
would, runs the same input ids, and prints one JSON line: max_abs_diff, dtype, num_params,
missing/unexpected keys.
"""
import json
import sys

import numpy as np
import torch
import transformers


def main():
    snapshot, ids_path, expected_path = sys.argv[1:4]
    ids = torch.from_numpy(np.load(ids_path).astype("int64"))
    expected = np.load(expected_path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        snapshot, output_loading_info=True, dtype=torch.float32
    )
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().numpy()
    out = {
        "max_abs_diff": float(np.max(np.abs(logits - expected))),
        "shape": list(logits.shape),
        "class": type(model).__name__,
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
        "transformers": transformers.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
