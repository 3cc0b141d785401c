"""Helpers shared by the tests of both environments (checks of exported Llama snapshots, subprocess runners)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from paddle_fullparam_callbacks.export.write.header import read_header, read_tensor

import json
import subprocess
import sys

ROOT = Path(__file__).resolve().parents[1]

# Linear weights: Paddle stores [in, out], HF [out, in]
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$")


def snapshot_tensors(snapshot: Path) -> dict:
    """{name: numpy array} of every tensor, read with our reader (bf16 as uint16 bits)."""
    out = {}
    for f in sorted(Path(snapshot).glob("*.safetensors")):
        _, entries, _ = read_header(f)
        for name in entries:
            out[name] = read_tensor(f, name)
    return out


def official_reader_tensors(snapshot: Path) -> dict:
    out = {}
    for f in sorted(Path(snapshot).glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as g:
            for k in g.keys():
                out[k] = g.get_tensor(k)
    return out


def expected_hf_tensors(model, hf_name_of, lm_head_is_linear: bool, dtype: str = "float32") -> dict:
    """The model's own parameters, renamed and transposed by hand (independently of the exporter)."""
    import paddle

    expected = {}
    for pname, p in model.state_dict().items():
        hf = hf_name_of(pname)
        if hf is None:
            continue
        t = p
        if dtype != "float32":
            t = paddle.cast(t, dtype)
        arr = t.numpy() if dtype != "bfloat16" else t.view(paddle.uint16).numpy() if hasattr(t, "view") else t.numpy()
        if arr.dtype != np.uint16 and dtype == "bfloat16":
            arr = arr.view(np.uint16)
        if LINEAR.search(hf) and (hf != "lm_head.weight" or lm_head_is_linear):
            arr = np.ascontiguousarray(arr.T)
        expected[hf] = arr
    return expected


def assert_bitwise_equal(got: dict, expected: dict) -> None:
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)))[:10]
    for k in expected:
        assert got[k].shape == expected[k].shape, k
        assert got[k].tobytes() == expected[k].tobytes(), f"{k} differs"


def run_hf_client(hf_python: str, snapshot: Path, input_ids: np.ndarray, logits: np.ndarray, tmp_path: Path) -> dict:
    """Load ``snapshot`` with transformers in a separate process; return its JSON report."""
    ids_path, logits_path = tmp_path / "ids.npy", tmp_path / "logits.npy"
    np.save(ids_path, input_ids)
    np.save(logits_path, logits)
    proc = subprocess.run(
        [hf_python, str(ROOT / "tests" / "hf_client" / "check_logits.py"), str(snapshot), str(ids_path), str(logits_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def use_snapshots(hf_python: str, *snapshots) -> dict:
    """Each snapshot used as people use one (tokenizer, generate, gguf's input checks: see
    ``hf_client/use_snapshot.py``), in the real-client environment; {snapshot path: report}."""
    proc = subprocess.run([hf_python, str(ROOT / "tests" / "hf_client" / "use_snapshot.py"), *map(str, snapshots)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paddle_fullparam_callbacks", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def paddle_logits(model, input_ids: np.ndarray, mode: str = "eval") -> np.ndarray:
    """Paddle's float32 logits; ``mode="train"`` for a model whose eval-mode forward is known to be
    wrong (PaddleFormers 1.2's GPT-OSS; tiny configs have no dropout, so both modes agree)."""
    import paddle

    model.train() if mode == "train" else model.eval()
    with paddle.no_grad():
        out = model(paddle.to_tensor(input_ids))
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    return out.astype("float32").numpy()


def listing(path) -> list:
    """Sorted names in ``path``, without the job's lock file and progress directory (everything else, hidden leftovers
    such as .tmp-* directories included, is listed)."""
    import os

    return sorted(p for p in os.listdir(path) if p not in (".fullparam.lock", ".fullparam-progress"))


class AtStep:
    """A trainer callback added after the export callback: ``at[step]()`` runs at that step's end, once the
    step's snapshot (if it has one) is committed."""

    def __init__(self, at: dict):
        self.at = at

    def __getattr__(self, attr):
        if attr.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(attr)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.at:
            self.at[state.global_step]()
