"""The FP8 rows of the model zoo: every case's trained model exported once more with ``export.quantization=fp8``.

Paddle half (``run_zoo.py`` calls :func:`export`): the model the case trained (or built) is exported again,
with blocks of 8 x 8 (the tiny models' dimensions are multiples of 8, so each weight has many blocks and
transformers' dequantization, which misreads a dimension that is not a multiple, applies), in the dtype of
the case's own snapshot (float32). An architecture without a declaration must be refused at start.

transformers half (``hf_check.py`` calls :func:`hf_check`, ``hf`` environment): the FP8 snapshot against the
case's own snapshot:

- every quantized weight's bytes and scales are those transformers' own ``Fp8Quantize`` gives for the case
  snapshot's weight, every other tensor is the case snapshot's, byte for byte;
- every Linear module of the transformers model (and every fused experts module) is either quantized in
  the snapshot or matched by ``modules_to_not_convert`` (what an engine would otherwise quantize);
- ``verify --transformers`` (meta device) passes, and the model transformers loads from the snapshot (it
  dequantizes on CPU) gives logits equal to those of the case snapshot with each quantized weight
  replaced by its dequantized value (``e4m3 * scale_inv`` block by block, computed here).

The Paddle-side test (:func:`check`) also checks the declaration against a rule of its own: the weights
quantized are every 2-D ``.weight`` of the text decoder's layers except router gates.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

BLOCK = [8, 8]
SEQ = 16
# the rule the declarations must follow, stated independently of them: decoder layers' 2-D weights, no router
DECODER = re.compile(r"(model\.(language_model\.)?layers|model\.decoder\.layers|transformer\.h)\.\d+\.")
ROUTER = re.compile(r"\.(gate|router|shared_expert_gate)\.weight$")
REFUSED = {"GPT2LMHeadModel", "GptOssForCausalLM"}  # no declaration: refused at start, naming the architecture


def export(case, model, work: Path) -> dict:
    """The FP8 snapshot of ``model`` (Paddle environment), or the refusal."""
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    out = work / "fp8"
    cfg = load_config(None, [f"output_dir={out}", "export.quantization=fp8", f"export.quantization_block={BLOCK}",
                             "export.copy_tokenizer=false"])
    try:
        source = build_model_source(model, cfg)
    except Exception as e:  # an architecture without a declaration: the test checks the message
        return {"refused": f"{type(e).__name__}: {e}"}
    session = ExportSession(cfg, out)
    session.start()
    try:
        info = session.export(source, 0, reason="zoo fp8")
    finally:
        session.close()
    return {"snapshot": str(info.path), "block": BLOCK}


def check(case, entry: dict, hf: dict) -> None:
    """The FP8 row of ``case`` (Paddle environment): the refusal, or the snapshot and what transformers made of it."""
    fp8 = entry.get("fp8") or {}
    if case.hf_class in REFUSED:
        assert "ConfigError: export.quantization: fp8 is not available for " + case.hf_class in fp8.get("refused", ""), fp8
        return
    assert fp8.get("snapshot"), fp8
    report = hf.get("fp8") or {}
    assert "error" not in report, report.get("error")
    assert report["verify"]["ok"], report["verify"]
    assert report["bytes_differ"] == [], report["bytes_differ"]
    assert report["unlisted_linear"] == [], report["unlisted_linear"]
    expected = sorted(n for n, shape in report["plain_shapes"].items()
                      if DECODER.match(n) and n.endswith(".weight") and len(shape) == 2 and not ROUTER.search(n))
    assert report["quantized"] == expected, (sorted(set(report["quantized"]) ^ set(expected)))
    assert report["dequantized_logits_diff"] == 0.0, report
    config = json.loads((Path(fp8["snapshot"]) / "config.json").read_text())
    assert config["dtype"] == "float32" and config["quantization_config"]["weight_block_size"] == BLOCK


# ---- transformers half ---------------------------------------------------------------------------------------
def _tensors(snapshot: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(snapshot).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dequantized(q, scale_inv, block):
    import torch

    b0, b1 = block
    s = scale_inv.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:q.shape[0], :q.shape[1]]
    return q.to(torch.float32) * s


def _logits(cls, snapshot, ids):
    import torch

    model = cls.from_pretrained(snapshot, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _unlisted(snapshot: str, cls, quantized: set, skip: list) -> list:
    """Linear (and fused experts) modules that transformers would convert to FP8 (``modules_to_not_convert``
    does not match them) but whose weights the snapshot does not quantize. Names go through transformers'
    own renames first, as its quantizer sends ``modules_to_not_convert`` through them."""
    import torch
    import transformers
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.quantizers.quantizers_utils import should_convert_module

    config = transformers.AutoConfig.from_pretrained(snapshot)
    del config.quantization_config
    with torch.device("meta"):
        model = cls.from_config(config)
    renamings = get_model_conversion_mapping(model)

    def renamed(name: str) -> str:
        for r in renamings:
            name, _ = r.rename_source_key(name)
        return name

    weights = set(quantized) | {renamed(n) for n in quantized}
    skip = [renamed(s + ".").removesuffix(".") for s in skip]
    out = []
    for name, module in model.named_modules():
        if not should_convert_module(name, skip):
            continue
        if type(module) is torch.nn.Linear and f"{name}.weight" not in weights:
            out.append(name)
        elif name.endswith(".experts") and not any(w.startswith(name + ".") for w in weights):
            out.append(name)
    return out


def hf_check(entry: dict) -> dict:
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    from paddle_fullparam_callbacks.export.verify.hf import verify_with_transformers

    fp8, plain = entry["fp8"]["snapshot"], entry["snapshot"]
    block = tuple(entry["fp8"]["block"])
    out = {"verify": verify_with_transformers(fp8).as_dict()}
    q, p = _tensors(fp8), _tensors(plain)
    quantized = sorted(n for n, t in q.items() if t.dtype == torch.float8_e4m3fn)
    out["quantized"], out["plain_shapes"] = quantized, {n: list(t.shape) for n, t in p.items()}
    rule = Fp8Quantize(type("Q", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=block)})())
    differ, dequantized = [], dict(p)
    for name, t in p.items():
        if name in quantized:
            ref = rule.convert({name: t})
            scale = name + "_scale_inv"
            same = (torch.equal(ref[name].view(torch.uint8), q[name].view(torch.uint8))
                    and torch.equal(ref[scale].view(torch.int32), q[scale].view(torch.int32)))
            dequantized[name] = _dequantized(q[name], q[scale], block)
        else:
            same = name in q and q[name].dtype == t.dtype and torch.equal(q[name].view(torch.uint8), t.view(torch.uint8))
        if not same:
            differ.append(name)
    extra = sorted(set(q) - set(p) - {n + "_scale_inv" for n in quantized})
    out["bytes_differ"] = differ + [f"{n} (not in the case's snapshot)" for n in extra]
    cls = transformers.AutoModelForImageTextToText if entry["fp8"].get("multimodal") else transformers.AutoModelForCausalLM
    skip = json.loads((Path(fp8) / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    out["unlisted_linear"] = _unlisted(fp8, cls, set(quantized), skip)
    # the dequantized weights in the case snapshot's place: transformers loads both the same way
    deq = Path(fp8).parent / "dequantized"
    deq.mkdir(exist_ok=True)
    for f in Path(plain).iterdir():
        if f.suffix == ".json" and not f.name.startswith("fullparam") and "index" not in f.name:
            (deq / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(deq / "model.safetensors"), metadata={"format": "pt"})
    vocab = int(json.loads((Path(plain) / "config.json").read_text()).get("vocab_size", 0) or 512)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, min(vocab, 500), (2, SEQ)).astype("int64"))
    out["dequantized_logits_diff"] = float((_logits(cls, fp8, ids) - _logits(cls, str(deq), ids)).abs().max())
    return out
