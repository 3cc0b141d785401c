"""The transformers half of the multimodal zoo rows (``hf`` environment; ``hf_check.py`` calls it).

For one snapshot of ``mm_zoo.py``: ``AutoModelForImageTextToText.from_pretrained`` of the snapshot as
written (with the loading info: missing, unexpected, mismatched keys), logits on text and on one image
compared with Paddle's, the tokenizer (``AutoTokenizer``) and the image processor
(``AutoImageProcessor``, which needs Pillow) loaded from the snapshot.

transformers needs ``mm_token_type_ids`` (1 at image tokens) for an image: without it Qwen3-VL,
PaddleOCR-VL and Glm4v-MoE refuse the input, and Qwen2.5-VL silently computes other logits.
"""
from __future__ import annotations

import numpy as np
import torch
import transformers


def _max_diff(a: np.ndarray, b: np.ndarray):
    return float(np.max(np.abs(a - b))) if a.shape == b.shape else None


def check(entry: dict) -> dict:
    snapshot = entry["snapshot"]
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        snapshot, dtype=torch.float32, output_loading_info=True)
    model.eval()
    out = {"class": type(model).__name__,
           "loading_info": {k: sorted(map(str, info.get(k, []))) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}}
    ids = torch.from_numpy(np.load(entry["ids"]).astype("int64"))
    with torch.no_grad():
        text = model(input_ids=ids).logits.float().numpy()
    out["max_abs_diff"] = _max_diff(text, np.load(entry["logits"]))
    inputs = dict(np.load(entry["image_inputs"]))
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == entry["image_token_id"]).to(torch.int64)
    with torch.no_grad():
        image = model(**kwargs).logits.float().numpy()
    out["image_max_abs_diff"] = _max_diff(image, np.load(entry["image_logits"]))
    tok = transformers.AutoTokenizer.from_pretrained(snapshot)
    out["tokenizer"] = {"class": type(tok).__name__, "image_token_id": tok.convert_tokens_to_ids(entry["image_token"])}
    enc = tok("The river town", return_tensors="pt")  # a text prompt, generated as people generate
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new = gen[0, enc["input_ids"].shape[1]:].tolist()
    out["generate"] = {"ids": new, "text": tok.decode(new, skip_special_tokens=True)}
    try:
        ip = transformers.AutoImageProcessor.from_pretrained(snapshot)
        out["image_processor"] = {"class": type(ip).__name__}
    except Exception as e:  # reported, the test decides
        out["image_processor"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out
