"""The multimodal rows of the model zoo: the Paddle half's hooks (``run_zoo.py``) and the checks of
their results (``zoo_suite.py``). Paddle and transformers are imported inside the functions, so the
checks run in either environment.

A multimodal case is trained like any other (3 steps on text, the callback at defaults), with what a
real job gives the Trainer: a tokenizer and the model's processor as ``processing_class``, and the
callback attached with ``attach(trainer)`` (PaddleFormers' Trainer hands callbacks its tokenizer
only). Then Paddle's logits are recorded on text and on one 16x16 image, for ``hf_mm.py``, and the
snapshot is reloaded by PaddleFormers itself.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np

SEQ = 16
FILLER = "<|reserved_{}|>"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# what every multimodal snapshot must hold beside the weights: tokenizer, image processor, chat template
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja")


def tokenizer_dir(tokens, directory: Path) -> Path:
    """A byte-level BPE of 512 ids whose special tokens sit at 500 and up, as the tiny configs say
    (image 500, video 501, vision start 502, vision end 503)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({FILLER.format(i): i for i in range(len(vocab), 500)})
    vocab.update({t: 500 + i for i, t in enumerate(tokens)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(tokens))
    tok.save(str(directory / "tokenizer.json"))
    eos = "<|im_end|>" if "<|im_end|>" in tokens else "<|endoftext|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": eos, "pad_token": "<|endoftext|>", "model_max_length": 128}))
    return directory


def _class(spec):
    module, name = spec
    return getattr(importlib.import_module(module), name)


def processor(case, work: Path):
    """(tokenizer, processor) of PaddleFormers for ``case``: its own processor classes with their defaults."""
    from paddleformers.transformers import AutoTokenizer

    mm = case.extra["multimodal"]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir(mm["tokens"], work / "tokenizer")))
    spec = mm["processor"]
    kwargs = {"image_processor": _class(spec["image"])(), "tokenizer": tok, "chat_template": TEMPLATE}
    if spec.get("video"):
        kwargs["video_processor"] = _class(spec["video"])()
    return tok, _class(spec["processor"])(**kwargs)


def train(case, model, work: Path):
    """3 steps of the real Trainer on text, tokenizer and processor given as a job gives them, the
    callback attached at defaults."""
    from paddleformers.trainer import Trainer
    from paddleformers.data import default_data_collator

    from paddle_fullparam_callbacks import attach
    from paddle_fullparam_callbacks.cli.demo import TokenDataset, trainer_args

    tok, proc = processor(case, work)
    args = trainer_args(case.framework, str(work / "trainer"), 3, save_steps=10_000)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=16, vocab=512), tokenizer=tok,
                      processing_class=proc, data_collator=default_data_collator)
    cb = attach(trainer, output_dir=str(work / "snapshots"))
    trainer.train()
    return cb


def text_ids() -> np.ndarray:
    ids = np.random.default_rng(7).integers(3, 500, (2, SEQ))
    ids[0, :3] = [0, 1, 2]  # pad, bos, eos
    return ids.astype("int64")


def image_inputs(layout: str):
    """input_ids with one image (4 image tokens between vision start and end) and its pixel inputs."""
    rng = np.random.default_rng(11)
    ids = text_ids()[:1].copy()
    ids[0, 3], ids[0, 4:8], ids[0, 8] = 502, 500, 503
    if layout == "flat":  # patches x (C * temporal patch * P * P)
        pixels = rng.standard_normal((16, 3 * 2 * 4 * 4))
    else:  # patches x C x P x P
        pixels = rng.standard_normal((16, 3, 4, 4))
    return ids, {"pixel_values": pixels.astype("float32"), "image_grid_thw": np.array([[1, 4, 4]], dtype="int64")}


def _logits(model, ids, extra=None) -> np.ndarray:
    import paddle

    model.eval()
    kwargs = {k: paddle.to_tensor(v) for k, v in (extra or {}).items()}
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor(ids), **kwargs)
    out = out.logits if hasattr(out, "logits") else out[0]
    return out.astype("float32").numpy()


def record(case, model, work: Path, reload=None) -> dict:
    """Paddle's logits of the trained model on text and on one image, saved for ``hf_mm.py``; with
    ``reload`` (ids -> the reloaded snapshot's logits), the framework's own reload compared too."""
    ids = text_ids()
    image_ids, pixels = image_inputs(case.extra["multimodal"]["image"])
    np.save(work / "ids.npy", ids)
    np.save(work / "logits.npy", _logits(model, ids))
    np.savez(work / "image_inputs.npz", input_ids=image_ids, **pixels)
    np.save(work / "image_logits.npy", _logits(model, image_ids, pixels))
    # the image must change the logits, or the image case compares nothing
    changed = float(np.max(np.abs(np.load(work / "image_logits.npy") - _logits(model, image_ids))))
    out = {}
    if reload is not None:
        try:
            out["reload_max_abs_diff"] = float(np.max(np.abs(reload(ids) - np.load(work / "logits.npy"))))
        except Exception as e:  # reported, the test decides
            out["reload_error"] = f"{type(e).__name__}: {e}"[:2000]
    return {**out, "multimodal": True, "ids": str(work / "ids.npy"), "logits": str(work / "logits.npy"),
            "image_inputs": str(work / "image_inputs.npz"), "image_logits": str(work / "image_logits.npy"),
            "image_effect": changed, "image_token_id": 500, "image_token": case.extra["multimodal"]["tokens"][0]}


# ---- checks (zoo_suite.py), either environment ------------------------------------------------

TOLERANCE = 1e-4
_NOT_IN_SUBCONFIGS = ("dtype", "torch_dtype", "return_dict", "use_cache", "architectures", "paddleformers_version")


def check(case, entry: dict, hf: dict) -> None:
    """A multimodal snapshot: loads as written with nothing missing or unexpected, text and image logits
    within 1e-4 of Paddle's, a config.json without Paddle-only keys at any level, processor files that
    transformers reads."""
    snapshot = Path(entry["snapshot"])
    config = json.loads((snapshot / "config.json").read_text())
    for key, sub in config.items():
        if isinstance(sub, dict) and "model_type" in sub:
            bad = [k for k in _NOT_IN_SUBCONFIGS if k in sub]
            q = sub.get("quantization_config")
            assert not bad and not (isinstance(q, dict) and not q.get("quant_method")), (key, bad)
            assert sub.get("tie_word_embeddings", entry["tied"]) is entry["tied"], (key, sub.get("tie_word_embeddings"))
    files = sorted(p.name for p in snapshot.iterdir())
    assert set(PROCESSOR_FILES) <= set(files), files
    assert hf.get("class") == case.hf_class, hf
    load = hf["loading_info"]
    assert load["missing_keys"] == [] and load["unexpected_keys"] == [] and load["mismatched_keys"] == [], load
    assert entry["image_effect"] > 1e-3, entry["image_effect"]
    assert hf["max_abs_diff"] is not None and hf["max_abs_diff"] <= TOLERANCE, hf
    assert hf["image_max_abs_diff"] is not None and hf["image_max_abs_diff"] <= TOLERANCE, hf
    assert hf["tokenizer"]["image_token_id"] == entry["image_token_id"], hf["tokenizer"]
    assert len(hf["generate"]["ids"]) == 8 and hf["generate"]["text"].strip(), hf["generate"]
    assert hf["image_processor"].get("class"), hf["image_processor"]
    if case.reload is None:  # PaddleFormers' own from_pretrained of the snapshot, single process, same logits
        assert entry.get("reload_error") is None, entry.get("reload_error")
        assert entry["reload_max_abs_diff"] <= TOLERANCE, entry
    else:  # a known defect of the framework's loader: still there (else this case should say so)
        assert entry.get("reload_error") or entry["reload_max_abs_diff"] > TOLERANCE, entry
