"""The checks ``bench/real_size.py`` makes of every snapshot (its child processes import them; paddle is imported
only by the functions that read a model).

- ``expected_digests``: BLAKE3 of every parameter of the model, in the HF name and layout of ``_real_size``'s
  own rule (the package's mapping is not asked);
- ``check_first``: ``verify`` (the files against the manifest: the package's checker), then every tensor read
  back from the files, tensor by tensor, against those digests;
- ``check_again``: ``verify``, and the files' BLAKE3 equal to the first snapshot's of the same kind (so their
  bytes equal the bytes the first check read back);
- ``hf_check``: ``tests/hf_client/check_real_size.py`` in the hf environment (transformers on the meta device;
  with a bf16 snapshot beside an FP8 one, ``Fp8Quantize`` on every quantized weight).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import _real_size as R

HERE = Path(__file__).resolve().parent


def param_view(p):
    """The parameter's bytes as a numpy array sharing its memory (DLPack; bfloat16 as uint16)."""
    import numpy as np
    import paddle

    t = p.detach()
    try:
        return np.from_dlpack(t.view(paddle.uint16) if t.dtype == paddle.bfloat16 else t)
    except (TypeError, RuntimeError, ValueError, BufferError):
        return t.numpy()


def expected_digests(model, d: dict) -> dict:
    """{HF name: ("BF16", HF shape, BLAKE3)} of every parameter, by this benchmark's own name and layout rule."""
    want = R.shapes(d)
    out = {}
    for name, p in model.named_parameters():
        a = R.hf_array(name, param_view(p))
        out[name] = ("BF16", tuple(a.shape), R.digest_array(a))
    if set(out) != set(want) or any(out[n][1] != tuple(s) for n, s in want.items()):
        raise SystemExit(f"_real_size.shapes() does not describe the model: {sorted(set(out) ^ set(want))[:5]}")
    return out


# ---- checks ---------------------------------------------------------------------------------------
def safetensors_digests(snapshot: Path) -> dict:
    files = json.loads((snapshot / "fullparam_manifest.json").read_text())["files"]
    return {k: v.get("blake3") for k, v in files.items() if k.endswith(".safetensors")}


def verify(snapshot: Path) -> dict:
    from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot

    t0 = time.perf_counter()
    r = verify_snapshot(snapshot)
    return {"verify_ok": r.ok, "verify_errors": r.errors[:5], "verify_s": round(time.perf_counter() - t0, 2)}


def check_first(snapshot: Path, expected: dict, names=None) -> dict:
    """verify, then every tensor read back from the files and compared with the model's (``names``: only those)."""
    out = verify(snapshot)
    t0 = time.perf_counter()
    want = expected if names is None else {n: v for n, v in expected.items() if n in names}
    got = R.snapshot_digests(snapshot, names)
    out["tensors"] = R.compare(want, got)
    out["readback_s"] = round(time.perf_counter() - t0, 2)
    out["ok"] = out["verify_ok"] and out["tensors"]["equal"]
    return out


def check_again(snapshot: Path, first: dict) -> dict:
    """verify; the files' BLAKE3 (the manifest's, which verify just checked) equal the first snapshot's."""
    out = verify(snapshot)
    out["same_files_as_first"] = safetensors_digests(snapshot) == first
    out["ok"] = out["verify_ok"] and out["same_files_as_first"]
    return out


def hf_check(hf_python: str, snapshot: Path, bf16: "Path | None" = None) -> dict:
    argv = [hf_python, str(HERE.parent / "tests" / "hf_client" / "check_real_size.py"), str(snapshot)]
    if bf16 is not None:
        argv += ["--bf16", str(bf16)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=7200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"tests/hf_client/check_real_size.py failed on {snapshot}:\n{proc.stderr[-3000:]}")
    report = json.loads(lines[-1])
    meta, fp8 = report["meta"], report.get("fp8")
    report["ok"] = ("error" not in meta and not meta["missing"] and not meta["unexpected"] and not meta["mismatched"]
                    and (fp8 is None or (fp8["wrong_count"] == 0 and not fp8["orphan_scales"] and fp8["quantized_weights"] > 0)))
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report
