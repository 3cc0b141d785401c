"""``verify --transformers``: would transformers load this snapshot without inventing weights?

Builds the architecture named in ``config.json`` and loads the snapshot on the meta device with
transformers' own loader (its renames and legacy-format conversions included), so no tensor bytes
are read. Missing keys are weights transformers would initialise at random; unexpected keys are
tensors it would ignore; mismatched keys have the wrong shape. Floating tensors whose dtype differs
from ``config.json``'s ``dtype`` are reported too.

Needs torch, transformers and accelerate (any environment that has them; Paddle is not needed).
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

from ..write.header import SafetensorsFormatError, read_header
from .quantized import SUFFIX, declares_fp8

_FLOAT = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass
class TransformersReport:
    path: str
    ok: bool = True
    architecture: str = ""
    missing: List[str] = field(default_factory=list)
    unexpected: List[str] = field(default_factory=list)
    mismatched: List[str] = field(default_factory=list)  # "name: file [..] vs model [..]"
    wrong_dtype: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)

    def problems(self) -> List[str]:
        out = list(self.errors)
        for label, items in (("missing (transformers would initialise them at random)", self.missing),
                             ("unexpected (transformers would ignore them)", self.unexpected),
                             ("of the wrong shape", self.mismatched), ("of another dtype than config.json's", self.wrong_dtype)):
            if items:
                more = f" and {len(items) - 5} more" if len(items) > 5 else ""
                out.append(f"{len(items)} tensor(s) {label}: {items[:5]}{more}")
        return out

    def as_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "architecture": self.architecture, "missing": self.missing,
                "unexpected": self.unexpected, "mismatched": self.mismatched, "wrong_dtype": self.wrong_dtype,
                "errors": self.errors}


def _file_dtypes(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        _, entries, _ = read_header(f)
        for name, e in entries.items():
            out[name] = e.dtype
    return out


def verify_with_transformers(directory: "str | Path") -> TransformersReport:
    d = Path(directory)
    report = TransformersReport(str(d))
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        report.ok = False
        report.errors.append(f"--transformers needs torch and transformers in this environment ({e})")
        return report
    try:
        config = json.loads((d / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        report.ok = False
        report.errors.append(f"config.json: cannot be read ({e})")
        return report
    archs = config.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else ""
    report.architecture = arch
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoModelForCausalLM
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            previous = logging.getLogger("transformers").level
            transformers.logging.set_verbosity_error()  # the report says what its warnings would
            try:
                _, info = cls.from_pretrained(str(d), device_map="meta", output_loading_info=True,
                                              ignore_mismatched_sizes=True)  # report them, do not stop
            finally:
                logging.getLogger("transformers").setLevel(previous)
    except Exception as e:  # any refusal of transformers is the answer to report
        report.ok = False
        report.errors.append(f"transformers cannot build {arch or 'the model'} from this snapshot: {type(e).__name__}: {e}")
        return report
    report.missing = sorted(info.get("missing_keys") or [])
    report.unexpected = sorted(info.get("unexpected_keys") or [])
    for item in info.get("mismatched_keys") or []:
        if isinstance(item, (tuple, list)) and len(item) == 3:
            name, file_shape, model_shape = item
            report.mismatched.append(f"{name}: file {list(file_shape)} vs model {list(model_shape)}")
        else:
            report.mismatched.append(str(item))
    report.mismatched.sort()
    declared = config.get("dtype") or config.get("torch_dtype")
    if isinstance(declared, str):
        try:
            dtypes = _file_dtypes(d)
        except (OSError, SafetensorsFormatError) as e:
            report.errors.append(str(e))
            dtypes = {}
        # an FP8 snapshot's scales are float32 by the layout, whatever the dtype of its other tensors
        scales = {n for n in dtypes if n.endswith(SUFFIX)} if declares_fp8(config) else set()
        report.wrong_dtype = sorted(f"{n}: {_FLOAT[t]}" for n, t in dtypes.items()
                                    if t in _FLOAT and _FLOAT[t] != declared and n not in scales)
    report.ok = not report.problems()
    return report
