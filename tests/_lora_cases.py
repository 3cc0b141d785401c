"""What the LoRA tests of both environments share: nonzero adapters, exports, Paddle logits, the
transformers + peft checks (``tests/hf_client/check_lora.py``, one process for many cases), and the
comparison of two snapshots with their adapters."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

from _helpers import ROOT, snapshot_tensors

IDS = (np.arange(24).reshape(2, 12) * 7 + 3) % 128  # below every tiny vocabulary; no padding id (0)
ADAPTER = "adapter"


def set_nonzero_lora(model, seed: int = 0, scale: float = 0.1) -> int:
    """Every ``lora_B`` (zero at init, which would make every check pass) := seeded values; returns how many."""
    import paddle

    rng = np.random.default_rng(seed)
    n = 0
    with paddle.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("lora_B"):
                p.set_value(paddle.to_tensor((scale * rng.standard_normal(p.shape)).astype(str(p.dtype).split(".")[-1])))
                n += 1
    return n


def export(model, out: Path, *overrides: str, step: int = 1):
    """One snapshot of ``model`` (a LoRAModel) with ExportSession, as the callback would write it."""
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}", "on_error=raise", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    try:
        return session.export(build_model_source(model, cfg), step, reason="test")
    finally:
        session.close()


def logits(model, ids=IDS) -> np.ndarray:
    import paddle

    model.eval()
    with paddle.no_grad():
        out = model(paddle.to_tensor(ids))
    out = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
    return out.astype("float32").numpy()


def hf_case(tmp: Path, name: str, merged: Path, paddle_logits=None, base: Path = None, adapter: bool = True,
            dtype: str = "float32") -> dict:
    """A case for ``check_lora.py``: the merged snapshot, the Paddle LoRA model's logits, the base weights'
    snapshot (negative control; with the adapter: peft's load and merge)."""
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / f"{name}-ids.npy", IDS)
    case = {"name": name, "merged": str(merged), "ids": str(tmp / f"{name}-ids.npy"), "dtype": dtype,
            "base": str(base) if base else None, "adapter": str(merged / ADAPTER) if adapter and base else None}
    if paddle_logits is not None:
        np.save(tmp / f"{name}-logits.npy", paddle_logits)
        case["logits"] = str(tmp / f"{name}-logits.npy")
    return case


def run_checks(hf_python: str, cases: list, tmp: Path) -> dict:
    """{case name: report} from one process of the hf environment."""
    path = tmp / "lora_cases.json"
    path.write_text(json.dumps(cases))
    proc = subprocess.run([hf_python, str(ROOT / "tests" / "hf_client" / "check_lora.py"), str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {c["name"]: r for c, r in zip(cases, json.loads(proc.stdout.strip().splitlines()[-1]))}
    if os.environ.get("PFC_LORA_REPORTS"):  # a directory: the reports kept for the docs' table of cases
        Path(os.environ["PFC_LORA_REPORTS"], f"{tmp.name}.json").write_text(json.dumps(reports, indent=1))
    return reports


def assert_hf_report(r: dict, peft: bool = True, tol: float = 1e-5) -> None:
    """The merged snapshot loads with no missing or unexpected key, matches Paddle's LoRA forward within
    ``tol``, and differs from the base weights' logits; peft loads the adapter whole; each merged tensor is the
    package's rule applied to peft's layers, bit for bit, and peft's own merge differs from it by no more than
    torch's float32 matmul may round (machine-dependent bits: only the bound is asserted)."""
    assert r["missing_keys"] == [] and r["unexpected_keys"] == [] and r["mismatched_keys"] == [], r
    if "merged_max_abs_diff" in r:
        assert r["merged_max_abs_diff"] <= tol, r
    if "vs_base_logits" in r:
        assert r["vs_base_logits"] > 100 * tol, r  # a zero or skipped update would pass everything else
    if peft:
        assert r["peft_missing_adapter_keys"] == [] and r["peft_unexpected_keys"] == [], r
        assert r["peft_modules"] * 2 == r["peft_adapter_tensors"], r
        assert r["rule"]["tensors"] == r["peft_modules"] and r["rule"]["rule_differ"] == [], r["rule"]
        assert r["vs_peft_merge"]["max_ratio_to_bound"] <= 1.0, r["vs_peft_merge"]
        if "peft_max_abs_diff" in r:
            assert r["peft_max_abs_diff"] <= tol, r


def assert_same_snapshots(a: Path, b: Path, adapter: bool = True) -> None:
    """The same tensors bit for bit (the model's and the adapter's), the same adapter config."""
    ta, tb = snapshot_tensors(a), snapshot_tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].tobytes() == tb[k].tobytes(), f"{k} differs"
    if adapter:
        assert_same_snapshots(a / ADAPTER, b / ADAPTER, adapter=False)
        assert (a / ADAPTER / "adapter_config.json").read_text() == (b / ADAPTER / "adapter_config.json").read_text()
