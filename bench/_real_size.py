"""Shared by ``bench/real_size*.py``: the model's dimensions, what a run needs, and the independent checks
of a snapshot's bytes. Nothing here imports paddle at module import time.

The checks are this benchmark's own, not the package's: the HF name and layout of each parameter come from
one rule written here (PaddleFormers' Llama keeps its names; its seven Linear weights per layer are Paddle's
``[in, out]`` and go out transposed; the embedding and the head are already ``[rows, hidden]``), and a
snapshot's tensors are read back with a safetensors header parsed here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Dict, Optional

# Qwen2.5-7B's dimensions on PaddleFormers' LlamaForCausalLM (its Qwen2 class needs paddlefleet, which does not
# install here; no q/k/v biases): 7,615,487,488 parameters, 15.23 GB in bfloat16, 255 tensors
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=False, fuse_rms_norm=False)
# --scale presets: the same widths (so the same per-tensor shapes, FP8 blocks and TP splits) with fewer layers
# and a smaller vocabulary; 'tiny' is the tiny mode's (PFC_BENCH_TINY=1): GQA and an untied head, a few MB
SCALES = {
    "full": {},
    "mid": dict(num_hidden_layers=4, vocab_size=32000),  # 2.32 GB
    "vocab": dict(num_hidden_layers=2),  # the real vocabulary: 3.11 GB, one file past 2 GiB
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128),  # 2.6 MB; every Linear dimension a multiple of
    # 128, as the real ones are: FP8 blocks whole (transformers misreads partial ones: plan/quantization.py)
}
BF16 = 2
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")  # Paddle [in, out]: the HF file holds the transpose
CHUNK = 64 * 2**20  # bytes read or hashed at a time


def dims(scale: str = "full", layers: Optional[int] = None, vocab: Optional[int] = None) -> dict:
    d = dict(QWEN25_7B, **SCALES[scale])
    if layers is not None:
        d["num_hidden_layers"] = layers
    if vocab is not None:
        d["vocab_size"] = vocab
    return d


def shapes(d: dict) -> Dict[str, tuple]:
    """{HF name: HF shape} of the model of dimensions ``d`` (Llama, untied head, no biases)."""
    h, i, v = d["hidden_size"], d["intermediate_size"], d["vocab_size"]
    kv = d["num_key_value_heads"] * (h // d["num_attention_heads"])
    out = {"model.embed_tokens.weight": (v, h)}
    for n in range(d["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return out


def model_bytes(d: dict) -> int:
    return sum(_numel(s) for s in shapes(d).values()) * BF16


def largest_tensor_bytes(d: dict) -> int:
    return max(_numel(s) for s in shapes(d).values()) * BF16


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


# ---- what a run needs ------------------------------------------------------------------------------
GB = 10**9
PROCESS_OVERHEAD = int(1.2 * GB)  # a Python process with paddle + paddleformers imported, and its allocator's slack
PF_SAVE_FACTOR = 2.05  # save_pretrained and save_state_dict hold 2x the model beside it (measured: 2.00-2.005x)


def needs(d: dict) -> dict:
    """Host memory and disk a run at ``d`` needs at its peak, with what each figure is made of.

    Memory: the model, the export's extra (<= 0.05x: the target), two processes besides it (this one's Paddle,
    and the hf-environment check that runs beside it); the async ring then takes half of what is left, by its
    rule, and save_pretrained runs at the largest size that fits (``pf_layers_that_fit``). Two ranks hold half the
    model each: the same. Disk: a bf16 snapshot and its ``cp -r`` copy (or the checkpoint and its conversion)
    side by side, and a margin."""
    m = model_bytes(d)
    return {"model_bytes": m, "memory_bytes": m + m // 20 + 2 * PROCESS_OVERHEAD + GB, "disk_bytes": 2 * m + 2 * GB,
            "memory_explained": "model + 0.05x model (the export) + 2 x 1.2 GB (this process, the hf check) + 1 GB",
            "disk_explained": "2x model (a snapshot and its cp -r copy, or the checkpoint and its conversion) + 2 GB"}


def pf_layers_that_fit(d: dict, available: int) -> int:
    """The most layers (same widths) whose model plus save_pretrained's 2x fits in ``available`` (0: none)."""
    layer = model_bytes(dict(d, num_hidden_layers=1)) - model_bytes(dict(d, num_hidden_layers=0))
    base = model_bytes(dict(d, num_hidden_layers=0))
    room = available - PROCESS_OVERHEAD - 2 * GB  # a margin: the machine is shared
    n = int((room / (1 + PF_SAVE_FACTOR) - base) // layer)
    return max(0, min(n, d["num_hidden_layers"]))


def meminfo() -> Dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts:
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def oom_kills() -> int:
    """The kernel's count of OOM kills since boot (/proc/vmstat ``oom_kill``)."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def machine_state(disk_dir: str) -> dict:
    mi = meminfo()
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "mem_available_bytes": mi.get("MemAvailable"),
            "mem_total_bytes": mi.get("MemTotal"), "swap_total_bytes": mi.get("SwapTotal"),
            "disk_free_bytes": shutil.disk_usage(disk_dir).free, "disk_dir": disk_dir, "oom_kills": oom_kills()}


def missing(need: dict, state: dict) -> Optional[str]:
    """One line naming what is not free, or None."""
    short = []
    if state["mem_available_bytes"] < need["memory_bytes"]:
        short.append(f"memory: needs {need['memory_bytes'] / GB:.1f} GB available, MemAvailable is "
                     f"{state['mem_available_bytes'] / GB:.1f} GB")
    if state["disk_free_bytes"] < need["disk_bytes"]:
        short.append(f"disk: needs {need['disk_bytes'] / GB:.1f} GB free in {state['disk_dir']}, "
                     f"{state['disk_free_bytes'] / GB:.1f} GB free")
    return "; ".join(short) or None


# ---- the checks of a snapshot's bytes --------------------------------------------------------------
def hf_array(name: str, paddle_array):
    """A parameter's values (numpy, bfloat16 as uint16 bits) in the HF layout: a view, transposed where the
    HF file holds the transpose."""
    return paddle_array.T if LINEAR.search(name) else paddle_array


def digest_array(a) -> str:
    """BLAKE3 of ``a``'s bytes in C order, ``CHUNK`` bytes of rows at a time (a transposed view is copied
    piecewise, so memory holds one piece)."""
    import blake3
    import numpy as np

    h = blake3.blake3()
    if a.ndim < 2:
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        return h.hexdigest()
    rows = max(1, CHUNK // max(1, a.shape[1] * a.itemsize))
    for r in range(0, a.shape[0], rows):
        h.update(np.ascontiguousarray(a[r:r + rows]).reshape(-1).view(np.uint8))
    return h.hexdigest()


def read_header(path: Path) -> tuple:
    """(data start, {name: (dtype, shape, begin, end)}) of a safetensors file, parsed here."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in header.items()}


def snapshot_tensors(snapshot: Path) -> Dict[str, tuple]:
    """{name: (file, dtype, shape, absolute begin, absolute end)} over the files the index names (or the one
    ``model.safetensors`` of a snapshot without an index)."""
    path = snapshot / "model.safetensors.index.json"
    if path.is_file():
        index = json.loads(path.read_text())["weight_map"]
    else:
        index = {n: "model.safetensors" for n in read_header(snapshot / "model.safetensors")[1]}
    out = {}
    for fname in sorted(set(index.values())):
        start, entries = read_header(snapshot / fname)
        for name, (dtype, shape, b, e) in entries.items():
            out[name] = (fname, dtype, shape, start + b, start + e)
    extra = sorted(set(out) - set(index))
    if extra:
        raise ValueError(f"{snapshot}: tensors in the files but not in the index: {extra[:5]}")
    return out


def digest_range(path: Path, begin: int, end: int) -> str:
    import blake3

    h = blake3.blake3()
    fd = os.open(path, os.O_RDONLY)
    try:
        off = begin
        while off < end:
            chunk = os.pread(fd, min(CHUNK, end - off), off)
            if not chunk:
                raise ValueError(f"{path}: ends at {off}, before {end}")
            h.update(chunk)
            off += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def snapshot_digests(snapshot: Path, names=None) -> Dict[str, tuple]:
    """{name: (dtype, shape, BLAKE3 of its bytes)} read back from the files, tensor by tensor (``names``: only
    those)."""
    out = {}
    for name, (fname, dtype, shape, b, e) in snapshot_tensors(snapshot).items():
        if names is None or name in names:
            out[name] = (dtype, shape, digest_range(snapshot / fname, b, e))
    return out


def compare(expected: Dict[str, tuple], got: Dict[str, tuple], limit: int = 10) -> dict:
    """Tensor by tensor: names missing or extra, dtype/shape/bytes that differ."""
    wrong = [n for n in sorted(expected) if n in got and tuple(got[n]) != tuple(expected[n])]
    return {"tensors": len(expected), "missing": sorted(set(expected) - set(got))[:limit],
            "extra": sorted(set(got) - set(expected))[:limit], "differ": wrong[:limit], "differ_count": len(wrong),
            "equal": not wrong and set(expected) == set(got)}
