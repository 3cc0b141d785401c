"""One decoder layer at published models' dimensions, exported through the public callback in bf16 and in FP8: every
byte against transformers' own ``Fp8Quantize``, FP8's time and CPU against bf16's (issue 46).

Run (about 40 minutes on a quiet machine, 7 repetitions; one layer at a time, each export in a fresh process after the machine is
idle)::

    PY=$(scripts/env.sh paddleformers)
    PFC_HF_PYTHON=$(scripts/env.sh hf) $PY bench/real_layers.py          # -> bench/results/real_layers.json
    $PY bench/real_layers.py --layers qwen2.5-7b,llama-3-8b --reps 3
    $PY bench/real_layers.py --before 0ff73e5~1   # also checks that revision's package (the commit before a fix)

Each layer is a one-layer model of its class, built on the CPU with bfloat16 parameters
(``paddle.set_default_dtype("bfloat16")``), the decoder layer at the published dimensions and a vocabulary of 1024
(the layer is the subject: its weights are nearly all of the model). ``LAYERS`` says which class builds which:
PaddleFormers 1.2's Qwen2/Qwen3/Qwen3-MoE classes import paddlefleet, which does not install here, so the Qwen
layers are Llama layers of their dimensions (the same Linear shapes; Qwen2.5's q/k/v biases are left out: they are
not quantized, and PaddleFormers' Llama mapping has no statement for them); the ERNIE layers are PaddleFormers' own
``Ernie4_5ForCausalLM`` and ``Ernie4_5_MoeForCausalLM`` (fused ``qkv_proj`` and ``up_gate_proj``, which the mapping
splits: the quantized weights are strided slices of them); the latter builds the Qwen3-30B-A3B MoE layer too. The
MoE layers hold 8 experts of the published size (the count only multiplies the time).

Every export goes through ``FullParamExportCallback`` as a Trainer drives it: ``on_train_begin`` (the plan, untimed),
then ``on_save`` at step 1, timed whole (decision, assembly, quantization, BLAKE3, writes, commit) with the RSS
sampler of ``_common`` (peak extra RSS over the RSS before the export) and ``CpuShare`` (the process's own CPU
seconds, user + system of every thread, and the share of the machine others used). Two variants, both
``export.dtype=bfloat16``: ``bf16`` (the plain snapshot: the parameters are bfloat16 already, so it is a transposed
copy into file order) and ``fp8`` (``export.quantization=fp8``, blocks of 128 x 128).

Per layer:

* ``check`` (once, a child of its own): both snapshots exported in one process (FP8 second, so its scratch
  buffers hold an earlier tensor's bytes: an element no one encodes shows as a difference), then
  ``tests/hf_client/fp8_snapshot_rule.py`` in the ``hf`` environment (``PFC_HF_PYTHON``, else ``scripts/env.sh
  hf``) compares, one weight at a time, every e4m3 weight and its ``weight_scale_inv`` with transformers'
  ``Fp8Quantize`` of the plain snapshot's tensor, and every other tensor with the plain snapshot's, byte for byte.
  The quantized weights must be exactly those the architecture's declaration names. A negative control flips one
  byte of the FP8 snapshot and the comparison must count exactly that byte;
* ``facts``: the arithmetic alone on one thread, ns per element, at each quantized shape of the layer: the
  bfloat16 transposed copy the plain export does against FP8's scales and bytes, and the bytes' stages (widen,
  scale, encode, transpose);
* ``fill_scaling``: the FP8 bytes of the layer's largest weight (and the bfloat16 copy of it) on 1 thread, on 2
  threads of one process (the writer's 2 MB row pieces dealt out between them), and by 2 processes at once: whether
  a second thread of the export can add what a second core could;
* ``reps`` paired repetitions of both variants in fresh processes, the order alternating, after waiting for idle
  CPUs (a run during which others used more than 20% of the CPUs is repeated, up to 3 tries, the least disturbed
  kept). Every timed FP8 snapshot must be the checked one, file for file (the manifests' BLAKE3).

Then one pair on one worker thread (``export.threads=1``), once. Reported per layer: median seconds and the paired
ratio fp8 / bf16; CPU seconds per element (the process's own user + system time during the export over the
snapshot's elements) for both, user and system apart; FP8's extra CPU per quantized element; the writer's
thread-seconds by stage; the quantized part's bytes ratio; peak extra RSS; the load average before each run; what
the second thread gives each variant; the check.
Before each layer the machine's MemAvailable must hold the layer's estimated peak (the bench stops, naming it,
otherwise); every estimate stays under 10 GB.

Targets (issue 40, unchanged by issue 46): ``time_ratio <= 1.15``, ``quantized_bytes_ratio <= 0.55``.

Tiny mode (``PFC_BENCH_TINY=1``): one Llama layer of hidden 320 and intermediate 704, which are not multiples of
the 128 block nor of the FP8 fill's chunk (64 K elements over 704 rows: 93-row steps, which do not divide 128),
one repetition, no waiting.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "real_layers.json"
HF_CLIENT = REPO / "tests" / "hf_client" / "fp8_snapshot_rule.py"
REGIMES = {"tmpfs": "/dev/shm", "disk": "/tmp"}
VARIANTS = ("bf16", "fp8")
ONE_THREAD = ("bf16_t1", "fp8_t1")  # once per layer, after the repetitions: what the second thread gives each
VOCAB = C.tiny(1024, 256)
BLOCK = (128, 128)
MEMORY_LIMIT = 10 * 2**30  # no layer's estimated peak may exceed it (the machine is shared)
WRITER_KEYS = ("copy_s", "fill_s", "hash_s", "write_s", "elapsed_s")  # the writer's thread-seconds, summed
TARGETS = {"time_ratio": "<= 1.15", "quantized_bytes_ratio": "<= 0.55"}


@dataclass(frozen=True)
class Layer:
    """A decoder layer at a published model's dimensions: the PaddleFormers class that builds it, its config."""

    model: str  # the published model whose dimensions these are
    kind: str  # "llama" | "ernie" | "ernie_moe": the PaddleFormers class
    dims: dict
    note: str = ""
    extra: dict = field(default_factory=dict)  # config keys that are not dimensions

    @property
    def classes(self) -> tuple:
        return {"llama": ("LlamaConfig", "LlamaForCausalLM"), "ernie": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
                "ernie_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM")}[self.kind]

    def config_kwargs(self) -> dict:
        return dict(vocab_size=VOCAB, num_hidden_layers=1, max_position_embeddings=256, fuse_rms_norm=False,
                    **self.dims, **self.extra)

    def parameters(self) -> int:
        """Elements of the model's parameters (the estimate of memory before anything is built)."""
        d = self.dims
        h, heads, kv = d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"]
        hd = d.get("head_dim") or h // heads
        attention = h * hd * (2 * heads + 2 * kv)
        if self.kind == "ernie_moe":
            mi, experts, shared = d["moe_intermediate_size"], d["moe_num_experts"], d["moe_num_shared_experts"]
            mlp = 3 * h * mi * (experts + shared) + h * experts
        else:
            mlp = 3 * h * d["intermediate_size"]
        heads_and_embeddings = VOCAB * h * (1 if self.extra.get("tie_word_embeddings") else 2)
        return attention + mlp + heads_and_embeddings + 3 * h


LLAMA = "a Llama layer of its dimensions (PaddleFormers 1.2's {} class imports paddlefleet, which does not install)"
LAYERS = {
    "qwen2.5-7b": Layer("Qwen2.5-7B", "llama", dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                                                    num_key_value_heads=4),
                        LLAMA.format("Qwen2") + "; without Qwen2's q/k/v biases (not quantized)",
                        dict(tie_word_embeddings=False)),
    "qwen3-8b": Layer("Qwen3-8B", "llama", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                                num_key_value_heads=8, head_dim=128),
                      LLAMA.format("Qwen3") + "; without Qwen3's q/k norms (not quantized)",
                      dict(tie_word_embeddings=False)),
    "llama-2-7b": Layer("Llama-2-7B", "llama", dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                                    num_key_value_heads=32), "", dict(tie_word_embeddings=False)),
    "llama-3-8b": Layer("Llama-3-8B", "llama", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                                    num_key_value_heads=8), "", dict(tie_word_embeddings=False)),
    "ernie-4.5-0.3b": Layer("ERNIE-4.5-0.3B", "ernie",
                            dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                 num_key_value_heads=2, head_dim=128),
                            "PaddleFormers' Ernie4_5ForCausalLM (fused qkv_proj and up_gate_proj, which the mapping "
                            "splits)", dict(tie_word_embeddings=True)),
    "ernie-4.5-21b-a3b-moe": Layer(
        "ERNIE-4.5-21B-A3B", "ernie_moe",
        dict(hidden_size=2560, intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=20,
             num_key_value_heads=4, head_dim=128, moe_num_experts=8, moe_num_shared_experts=2),
        "PaddleFormers' Ernie4_5_MoeForCausalLM: one MoE layer, experts of the published size (2560 x 1536) but 8 "
        "of the 64 (every expert the same shape: the count only multiplies the time), the 2 shared experts (one MLP "
        "of 3072), the router gate (float32, not quantized); its forward needs GPU kernels, the export does not",
        dict(moe_k=6, moe_layer_start_index=0, num_nextn_predict_layers=0, tie_word_embeddings=True)),
    "qwen3-30b-a3b-moe": Layer(
        "Qwen3-30B-A3B", "ernie_moe",
        dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128, moe_num_experts=8, moe_num_shared_experts=0),
        "PaddleFormers' Ernie4_5_MoeForCausalLM at Qwen3-30B-A3B's dimensions (its Qwen3-MoE class imports "
        "paddlefleet): one MoE layer, experts of the published size (2048 x 768) but 8 of the 128, no shared expert "
        "(as Qwen3-MoE), the router gate; the snapshot is an Ernie4_5_Moe one",
        dict(moe_k=8, moe_layer_start_index=0, num_nextn_predict_layers=0, tie_word_embeddings=False)),
}
TINY_LAYERS = {
    "tiny": Layer("none (hidden 320, intermediate 704: not multiples of the block or the chunk)", "llama",
                  dict(hidden_size=320, intermediate_size=704, num_attention_heads=5, num_key_value_heads=1),
                  "PaddleFormers' LlamaForCausalLM", dict(tie_word_embeddings=False)),
}
ALL_LAYERS = C.tiny(LAYERS, TINY_LAYERS)


def overrides(variant: str, out: Path) -> list:
    """The recipe of ``variant``: ``bf16`` or ``fp8``, ``_t1``: on one worker thread (``export.threads=1``)."""
    base = [f"output_dir={out}", "trigger.on_save=true", "trigger.on_train_end=false", "export.dtype=bfloat16",
            "export.copy_tokenizer=false", "export.timeout_s=600"]
    base += ["export.threads=1"] if variant.endswith("_t1") else []
    return base + (["export.quantization=fp8"] if variant.startswith("fp8") else [])


def hf_python() -> str:
    return os.environ.get("PFC_HF_PYTHON") or subprocess.run(
        ["bash", str(REPO / "scripts" / "env.sh"), "hf"], capture_output=True, text=True, check=True).stdout.strip()


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def estimated_peak(layer: Layer) -> int:
    """Bytes the check of ``layer`` may hold at once: the Paddle process (~0.8 GB besides the model), the model in
    bfloat16, both snapshots on tmpfs (1.5x the model), the hf process (~0.6 GB besides a few float32 copies of the
    largest weight, bounded here by the model)."""
    model = 2 * layer.parameters()
    return int(0.8 * 2**30 + model + 1.5 * model + 0.6 * 2**30 + 2 * model)


# ---- children --------------------------------------------------------------------------------------------------
def build(layer: Layer, seed: int = 0):
    import paddle

    paddle.set_device("cpu")
    paddle.set_default_dtype("bfloat16")
    paddle.seed(seed)
    import paddleformers.transformers as pt

    config_class, model_class = layer.classes
    model = getattr(pt, model_class)(getattr(pt, config_class)(**layer.config_kwargs()))
    model.eval()
    return model


class Driver:
    """``FullParamExportCallback`` driven as a Trainer drives it: ``on_train_begin``, then ``on_save`` at step 1."""

    def __init__(self, model, variant: str, out: Path):
        import types

        from paddle_fullparam_callbacks import FullParamExportCallback

        self.model = model
        self.cb = FullParamExportCallback(None, overrides=overrides(variant, out))
        self.args = types.SimpleNamespace(output_dir=str(out) + "-trainer")
        self.state = types.SimpleNamespace(global_step=0, log_history=[])
        self.control = types.SimpleNamespace()
        self.cb.on_train_begin(self.args, self.state, self.control, model=model)

    def save(self):
        self.state.global_step += 1
        self.cb.on_save(self.args, self.state, self.control, model=self.model)
        if self.cb.errors or not self.cb.snapshots:
            raise RuntimeError(f"the export failed: {self.cb.errors}")
        return self.cb.snapshots[-1]

    def close(self) -> None:
        self.cb.session.close()


def snapshot_figures(path: Path) -> dict:
    """Elements and bytes of the snapshot's tensors: all, and those of the quantized part (e4m3 bytes and their
    scales, or in a plain snapshot the weights an FP8 one quantizes); the manifest's BLAKE3 of each file."""
    from paddle_fullparam_callbacks.export.write.header import read_header
    from paddle_fullparam_callbacks.models.mappings.fp8 import DECLARATIONS

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    pattern = DECLARATIONS[arch].pattern
    out = {"architecture": arch, "tensor_bytes": 0, "quantized_part_bytes": 0, "elements": 0, "quantized_elements": 0,
           "quantized_weights": 0}
    for f in sorted(path.glob("*.safetensors")):
        _, entries, _ = read_header(f)
        for name, e in entries.items():
            n = e.end - e.begin
            elements = 1
            for s in e.shape:
                elements *= s
            out["tensor_bytes"] += n
            scale = name.endswith("_scale_inv")
            weight = name[:-len("_scale_inv")] if scale else name
            quantized = bool(pattern.fullmatch(weight))
            out["quantized_part_bytes"] += n if quantized else 0
            if not scale:
                out["elements"] += elements
                out["quantized_elements"] += elements if quantized else 0
                out["quantized_weights"] += int(quantized)
    manifest = json.loads((path / "fullparam_manifest.json").read_text())
    out["files_blake3"] = {k: v["blake3"] for k, v in manifest["files"].items() if k.endswith(".safetensors")}
    return out


def child_timed(layer: Layer, variant: str, out: Path) -> dict:
    import gc
    import resource

    C.quiet_logs()
    model = build(layer)
    writer_stats = C.record_writer_stats()
    driver = Driver(model, variant, out)
    gc.collect()
    C.trim_heap()
    load = os.getloadavg()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    with C.RssSampler(0.005) as rss, C.CpuShare() as cpu:
        t0 = time.perf_counter()
        info = driver.save()
        seconds = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    driver.close()
    usage = {"user_s": round(r1.ru_utime - r0.ru_utime, 4), "sys_s": round(r1.ru_stime - r0.ru_stime, 4),
             "minor_faults": r1.ru_minflt - r0.ru_minflt, "context_switches": (r1.ru_nvcsw - r0.ru_nvcsw)
             + (r1.ru_nivcsw - r0.ru_nivcsw)}
    return {"variant": variant, "seconds": seconds, "cpu": cpu.as_dict(), "usage": usage, "peak_extra_rss": rss.extra,
            "process_peak_rss": C.ru_maxrss_bytes(), "loadavg_1m": round(load[0], 2),
            "writer_stats": writer_stats[-1] if writer_stats else {}, **snapshot_figures(Path(info.path))}


def child_check(layer: Layer, out: Path) -> dict:
    """Both snapshots in one process (FP8 second), then transformers' rule on every quantized weight."""
    import resource

    from paddle_fullparam_callbacks.export.write.header import read_header
    from paddle_fullparam_callbacks.models.mappings.fp8 import DECLARATIONS

    C.quiet_logs()
    model = build(layer)
    paths = {}
    for v in VARIANTS:
        d = Driver(model, v, out / v)
        paths[v] = Path(d.save().path)
        d.close()
    del model
    figures = {v: snapshot_figures(p) for v, p in paths.items()}
    hf = hf_python()
    report = compare(hf, paths["fp8"], paths["bf16"])
    # the weights quantized are exactly those the declaration names among the plain snapshot's tensors
    arch = figures["bf16"]["architecture"]
    plain = {n: e.shape for f in sorted(paths["bf16"].glob("*.safetensors")) for n, e in read_header(f)[1].items()}
    declared, _ = DECLARATIONS[arch](plain.items())
    result = summarize_check(report)
    result["declared_equals_quantized"] = sorted(declared) == sorted(report["quantized"])
    result["control"] = negative_control(hf, paths, report)
    tmpfs = sum(f.stat().st_size for p in paths.values() for f in p.rglob("*") if f.is_file())
    hf_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result.update(architecture=arch, snapshot_files_bytes=tmpfs, process_peak_rss=C.ru_maxrss_bytes(),
                  hf_peak_rss=hf_peak, peak_memory_bound_bytes=C.ru_maxrss_bytes() + hf_peak + tmpfs,
                  fp8_files_blake3=figures["fp8"]["files_blake3"], figures={v: {k: x for k, x in f.items()
                                                                                if k != "files_blake3"}
                                                                            for v, f in figures.items()})
    return result


def compare(hf: str, fp8: Path, plain: Path, only=()) -> dict:
    proc = subprocess.run([hf, str(HF_CLIENT), str(fp8), str(plain), *only], capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{HF_CLIENT.name} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize_check(report: dict) -> dict:
    q = report["quantized"]
    per_tensor = {n: {"shape": r["shape"], "differing_bytes": r["differing_bytes"],
                      "differing_fraction": round(r["differing_bytes"] / max(1, r["elements"]), 4),
                      "differing_scales": r["differing_scales"], "examples": r["examples"]} for n, r in q.items()}
    differing = sum(r["differing_bytes"] for r in q.values())
    scales = sum(max(0, r["differing_scales"]) for r in q.values())
    bad_scale_shapes = [n for n, r in q.items() if r["differing_scales"] < 0]
    identical = (differing == 0 and scales == 0 and not bad_scale_shapes and not report["others_differing"]
                 and not report["missing"] and not report["extra"] and bool(q))
    return {"bytes_identical": identical, "quantized_weights": len(q),
            "quantized_elements": sum(r["elements"] for r in q.values()), "differing_bytes": differing,
            "differing_scales": scales, "scale_shapes_wrong": bad_scale_shapes,
            "others_compared": report["others_compared"], "others_differing": report["others_differing"],
            "missing": report["missing"], "extra": report["extra"], "hf_seconds": report["seconds"],
            "per_tensor": per_tensor}


def negative_control(hf: str, paths: dict, report: dict) -> dict:
    """One byte of the smallest quantized weight flipped in the FP8 snapshot: the comparison must count exactly it."""
    from paddle_fullparam_callbacks.export.write.header import read_header

    name = min(report["quantized"], key=lambda n: report["quantized"][n]["elements"])
    for f in sorted(paths["fp8"].glob("*.safetensors")):
        _, entries, start = read_header(f)
        if name in entries:
            break
    e = entries[name]
    at = start + e.begin + (e.end - e.begin) // 2
    with open(f, "r+b") as h:
        h.seek(at)
        byte = h.read(1)[0]
        h.seek(at)
        h.write(bytes([byte ^ 0x01]))
    try:
        got = compare(hf, paths["fp8"], paths["bf16"], ("--only", name))["quantized"][name]["differing_bytes"]
    finally:
        with open(f, "r+b") as h:
            h.seek(at)
            h.write(bytes([byte]))
    return {"tensor": name, "flipped_bytes": 1, "counted": got, "caught": got == 1}


def child_facts(layer: Layer) -> dict:
    """ns per element of the arithmetic alone, one thread, on each quantized shape of the layer (Paddle's [in, out]
    bfloat16 parameter; the snapshot holds its transpose): the plain export's transposed copy, FP8's scales and
    bytes, and the bytes' stages in the memory-order fill's 64 K-element chunks."""
    import numpy as np

    from paddle_fullparam_callbacks.host import fp8 as F
    from paddle_fullparam_callbacks.host import quantize as Q
    from paddle_fullparam_callbacks.host.casts import scratch
    from paddle_fullparam_callbacks.host.copy import copy_into, row_blocks
    from paddle_fullparam_callbacks.host.pool import WorkerPool, using

    d = layer.dims
    h = d["hidden_size"]
    hd = d.get("head_dim") or h // d["num_attention_heads"]
    inter = d.get("moe_intermediate_size") if layer.kind == "ernie_moe" else d["intermediate_size"]
    shapes = sorted({(h, d["num_attention_heads"] * hd), (h, d["num_key_value_heads"] * hd),
                     (d["num_attention_heads"] * hd, h), (h, inter), (inter, h)})
    rng = np.random.default_rng(1)
    reps = C.tiny(3, 1)

    def timed(fn, n):
        return C.best_ns_per_element(fn, n, reps)

    def fill(lazy, buf):
        for r0, r1 in row_blocks(lazy, 2 * 2**20):
            lazy.rows(r0, r1).fill(buf[r0:r1])

    def stages(memory, q):
        """The bytes' passes as the writer runs them (``Fp8Array._fill_memory_order`` on its 2 MB row pieces), each
        pass timed on its own: the widening of the bfloat16 source, the product by the block's scale, the e4m3
        encoding (round-to-odd key, table look-up), the transpose of the bytes into file order."""
        t = dict(widen=0.0, scale=0.0, encode=0.0, transpose_bytes=0.0)
        out = np.empty(memory.T.shape, np.uint8)
        for r0, r1 in row_blocks(q.weight, 2 * 2**20):
            n = r1 - r0
            scales = np.ascontiguousarray(q.scale[np.arange(r0, r1) // BLOCK[0]].T)
            codes = np.empty((memory.shape[0], n), np.uint8)
            step = max(1, min(BLOCK[1], Q._CHUNK // n))
            c0 = 0
            while c0 < memory.shape[0]:
                j = c0 // BLOCK[1]
                c1 = min(memory.shape[0], c0 + step, (j + 1) * BLOCK[1])
                t0 = time.perf_counter()
                values = Q.widened(memory[c0:c1, r0:r1], "bfloat16", "facts widened")
                t1 = time.perf_counter()
                y = scratch(values.size * 4, "facts product").view(np.float32).reshape(values.shape)
                np.multiply(values, scales[j], out=y)
                t2 = time.perf_counter()
                F.encode_e4m3(codes[c0:c1], y)
                t3 = time.perf_counter()
                t["widen"] += t1 - t0
                t["scale"] += t2 - t1
                t["encode"] += t3 - t2
                c0 = c1
            t0 = time.perf_counter()
            copy_into(out[r0:r1], codes.T)
            t["transpose_bytes"] += time.perf_counter() - t0
        return {k: round(v / memory.size * 1e9, 3) for k, v in t.items()}

    def copy(plain, hf_view):
        for r0, r1 in row_blocks(hf_view, 2 * 2**20):  # the writer's blocks of a strided tensor
            copy_into(plain[r0:r1], hf_view[r0:r1])

    out = {}
    with using(WorkerPool(1)):
        for shape in shapes:
            w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits, as a Paddle parameter holds them
            hf_view = bits.T  # the snapshot's [out, in]
            plain = np.empty(hf_view.shape, np.uint16)
            q = Q.Fp8Weight(hf_view, "bfloat16", BLOCK)
            codes = np.empty(hf_view.shape, np.uint8)
            out[f"hf{list(hf_view.shape)}"] = {
                "bf16_copy_ns": timed(lambda: copy(plain, hf_view), w.size),
                "fp8_scales_ns": timed(lambda: Q.Fp8Weight(hf_view, "bfloat16", BLOCK), w.size),
                "fp8_bytes_ns": timed(lambda: fill(q.weight, codes), w.size),
                "fp8_bytes_stages_ns": min((stages(bits, q) for _ in range(reps)), key=lambda x: sum(x.values()))}
    return {"variant": "facts", "one_thread_ns_per_element": out}


def largest_shape(layer: Layer) -> tuple:
    """Paddle's [in, out] of the layer's largest quantized weight (its MLP's, or an expert's)."""
    d = layer.dims
    inter = d.get("moe_intermediate_size") if layer.kind == "ernie_moe" else d["intermediate_size"]
    return d["hidden_size"], inter


def child_fill(layer: Layer, threads: int) -> dict:
    """The FP8 bytes of the layer's largest weight (and, for comparison, the plain export's transposed bfloat16
    copy of it) on ``threads`` threads of this process, the writer's 2 MB row pieces dealt out between them: wall and
    CPU ns per element (the best of 3). Two such processes at once tell the threads' contention from the machine's."""
    import threading

    import numpy as np

    from paddle_fullparam_callbacks.host import quantize as Q
    from paddle_fullparam_callbacks.host.copy import copy_into, row_blocks
    from paddle_fullparam_callbacks.host.pool import WorkerPool, using

    w = np.random.default_rng(1).standard_normal(largest_shape(layer), dtype=np.float32) * np.float32(0.02)
    hf_view = ((w.view(np.uint32) >> 16).astype(np.uint16)).T  # a bfloat16 parameter's transpose
    with using(WorkerPool(1)):
        q = Q.Fp8Weight(hf_view, "bfloat16", BLOCK)
    codes, plain = np.empty(hf_view.shape, np.uint8), np.empty(hf_view.shape, np.uint16)
    pieces = list(row_blocks(q.weight, 2 * 2**20))

    def fp8(part):
        for r0, r1 in part:
            q.weight.rows(r0, r1).fill(codes[r0:r1])

    def bf16(part):
        for r0, r1 in part:
            copy_into(plain[r0:r1], hf_view[r0:r1])

    def run(fn):
        threads_ = [threading.Thread(target=fn, args=(pieces[i::threads],)) for i in range(threads)]
        c0, t0 = time.process_time(), time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        return time.perf_counter() - t0, time.process_time() - c0

    out = {"shape": list(hf_view.shape), "threads": threads}
    for name, fn in (("fp8_bytes", fp8), ("bf16_copy", bf16)):
        fn(pieces)
        wall, cpu = min(run(fn) for _ in range(C.tiny(3, 1)))
        out[name] = {"wall_ns": round(wall / w.size * 1e9, 3), "cpu_ns": round(cpu / w.size * 1e9, 3)}
    return out


# ---- the parent ------------------------------------------------------------------------------------------------
def run_child(args: list, env=None) -> dict:
    return C.run_child([__file__, *args], timeout=1800, env=env)


def fill_scaling(name: str, quiet_wait: float) -> dict:
    """The layer's largest weight filled on 1 thread, on 2 threads of one process, and by 2 processes at once."""
    args = [__file__, "--child", "fill", "--layer", name, "--threads"]
    C.wait_quiet(quiet_wait)
    out = {"one_thread": run_child(args[1:] + ["1"]), "two_threads": run_child(args[1:] + ["2"])}
    C.wait_quiet(quiet_wait)
    procs = [subprocess.Popen([sys.executable, *args, "1"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    both = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    out["two_processes"] = both
    for k in ("one_thread", "two_threads"):
        out[k].pop("process_seconds", None)
    one, two, procs2 = out["one_thread"], out["two_threads"], out["two_processes"]
    out["speedup"] = {v: {"two_threads": round(one[v]["wall_ns"] / two[v]["wall_ns"], 2),
                          "two_processes": round(2 * one[v]["wall_ns"] / max(p[v]["wall_ns"] for p in procs2), 2)}
                      for v in ("fp8_bytes", "bf16_copy")}
    return out


def timed_runs(name: str, regime: str, reps: int, quiet_wait: float, variants=VARIANTS) -> dict:
    runs = {v: [] for v in variants}
    for rep in range(reps):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            r = C.least_disturbed_child(lambda out: [__file__, "--child", v, "--layer", name, "--out", str(out)],
                                        f"pfc-bench-layer-{v}-", REGIMES[regime], quiet_wait, timeout=1800,
                                        loadavg=True)
            runs[v].append(r)
            print(f"  {name} rep {rep + 1}/{reps} {regime:>5} {v:>4}: {r['seconds']:6.3f} s, own CPU "
                  f"{r['cpu']['own_cpu_s']:6.3f} s, peak extra RSS {r['peak_extra_rss'] / 2**20:6.1f} MiB, "
                  f"others {r['cpu']['foreign_fraction']:.0%}, load {r['loadavg_1m']}", flush=True)
    return runs


def summary(runs: dict) -> dict:
    med = lambda xs: C.median(xs)  # noqa: E731
    sec = {v: round(med([r["seconds"] for r in rs]), 4) for v, rs in runs.items()}
    cpu = {v: round(med([r["cpu"]["own_cpu_s"] for r in rs]), 4) for v, rs in runs.items()}
    paired = [round(f["seconds"] / b["seconds"], 3) for b, f in zip(runs["bf16"], runs["fp8"])]
    paired_cpu = [round(f["cpu"]["own_cpu_s"] / b["cpu"]["own_cpu_s"], 3) for b, f in zip(runs["bf16"], runs["fp8"])]
    first = {v: rs[0] for v, rs in runs.items()}
    elements = first["bf16"]["elements"]
    quantized = first["fp8"]["quantized_elements"]
    extra_cpu = [(f["cpu"]["own_cpu_s"] - b["cpu"]["own_cpu_s"]) / quantized * 1e9
                 for b, f in zip(runs["bf16"], runs["fp8"])]
    return {
        "seconds": sec, "all_seconds": {v: [round(r["seconds"], 4) for r in rs] for v, rs in runs.items()},
        "time_ratio": round(sec["fp8"] / sec["bf16"], 3), "all_time_ratio": paired,
        "median_paired_time_ratio": round(med(paired), 3),
        "cpu_s": cpu, "all_cpu_s": {v: [r["cpu"]["own_cpu_s"] for r in rs] for v, rs in runs.items()},
        "median_paired_cpu_ratio": round(med(paired_cpu), 3),
        "user_sys_s": {v: {k: round(med([r["usage"][k] for r in rs]), 4) for k in ("user_s", "sys_s")}
                       for v, rs in runs.items()},
        "context_switches": {v: int(med([r["usage"]["context_switches"] for r in rs])) for v, rs in runs.items()},
        "cpu_ns_per_element": {v: round(cpu[v] / elements * 1e9, 3) for v in VARIANTS},
        "wall_ns_per_element": {v: round(sec[v] / elements * 1e9, 3) for v in VARIANTS},
        "fp8_extra_cpu_ns_per_quantized_element": round(med(extra_cpu), 3),
        "elements": elements, "quantized_elements": quantized,
        "tensor_bytes": {v: r["tensor_bytes"] for v, r in first.items()},
        "quantized_part_bytes": {v: r["quantized_part_bytes"] for v, r in first.items()},
        "bytes_ratio": round(first["fp8"]["tensor_bytes"] / first["bf16"]["tensor_bytes"], 4),
        "quantized_bytes_ratio": round(first["fp8"]["quantized_part_bytes"] / first["bf16"]["quantized_part_bytes"], 4),
        "peak_extra_rss_bytes": {v: int(med([r["peak_extra_rss"] for r in rs])) for v, rs in runs.items()},
        "process_peak_rss_bytes": {v: max(r["process_peak_rss"] for r in rs) for v, rs in runs.items()},
        "writer_thread_s": {v: {k: round(med([r["writer_stats"].get(k, 0) for r in rs]), 4) for k in WRITER_KEYS}
                            for v, rs in runs.items()},
        "loadavg_1m": {v: [r["loadavg_1m"] for r in rs] for v, rs in runs.items()},
        "foreign_cpu_fraction": {v: [r["cpu"]["foreign_fraction"] for r in rs] for v, rs in runs.items()},
        "disturbed_tries": {v: [r["disturbed_tries"] for r in rs] for v, rs in runs.items()},
    }


def one_thread(runs: dict, entry: dict) -> dict:
    """The pair on one worker thread: its seconds and CPU, and the speed-up the second thread gives each variant."""
    sec = {v[:-3]: round(rs[0]["seconds"], 4) for v, rs in runs.items()}
    cpu = {v[:-3]: rs[0]["cpu"]["own_cpu_s"] for v, rs in runs.items()}
    return {"seconds": sec, "cpu_s": cpu, "time_ratio": round(sec["fp8"] / sec["bf16"], 3),
            "cpu_ns_per_element": {v: round(c / entry["elements"] * 1e9, 3) for v, c in cpu.items()},
            "speedup_2_threads_vs_1": {v: round(sec[v] / entry["seconds"][v], 3) for v in VARIANTS},
            "loadavg_1m": {v[:-3]: rs[0]["loadavg_1m"] for v, rs in runs.items()},
            "foreign_cpu_fraction": {v[:-3]: rs[0]["cpu"]["foreign_fraction"] for v, rs in runs.items()}}


def check_layer(name: str, regime: str, env=None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pfc-bench-layer-check-", dir=REGIMES[regime]))
    try:
        return run_child(["--child", "check", "--layer", name, "--out", str(tmp)], env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def before_tree(spec: str) -> tuple:
    """(a tree holding the package, its label): ``spec`` a checkout, or a revision of this repository whose package
    is extracted (``git archive``) into a temporary folder."""
    if Path(spec).is_dir():
        tree = C.existing_tree(spec)
        return tree, str(tree)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", spec], capture_output=True, text=True)
    if rev.returncode != 0:
        raise C.MissingInput(f"real_layers.py: --before {spec} is neither a checkout nor a revision of {REPO}")
    tree = Path(tempfile.mkdtemp(prefix="pfc-bench-before-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, "paddle_fullparam_callbacks"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return C.existing_tree(tree), f"{rev.stdout.strip()} ({spec})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default=",".join(ALL_LAYERS), help="comma-separated, of: " + ", ".join(ALL_LAYERS))
    ap.add_argument("--reps", type=int, default=C.tiny(7, 1))
    ap.add_argument("--regime", choices=tuple(REGIMES), default="tmpfs")
    ap.add_argument("--quiet-wait", type=float, default=90.0, help="seconds to wait for idle CPUs before a run")
    ap.add_argument("--before", help="a checkout or a revision of this repository (e.g. the commit before a fix): its "
                                     "package's FP8 snapshots are checked too (check_before), not timed")
    ap.add_argument("--result", default=str(RESULT_PATH))
    ap.add_argument("--update", action="store_true", help="keep the other layers of an existing --result (a layer "
                                                           "measured again replaces its entry)")
    ap.add_argument("--child", choices=VARIANTS + ONE_THREAD + ("check", "facts", "fill"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--layer", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the temporary folders are removed

    if ns.child:
        layer = ALL_LAYERS[ns.layer]
        if ns.child == "check":
            result = child_check(layer, Path(ns.out))
        elif ns.child == "facts":
            result = child_facts(layer)
        elif ns.child == "fill":
            result = child_fill(layer, ns.threads)
        else:
            result = child_timed(layer, ns.child, Path(ns.out))
        print(json.dumps(result), flush=True)
        return

    names = [n.strip() for n in ns.layers.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_LAYERS]
    if unknown:
        raise SystemExit(f"real_layers.py: unknown layer(s) {unknown}; known: {', '.join(ALL_LAYERS)}")
    before, before_label = before_tree(ns.before) if ns.before else (None, None)
    try:
        measure(ns, names, before, before_label)
    finally:
        if before is not None and not Path(ns.before).is_dir():
            shutil.rmtree(before, ignore_errors=True)  # the tree extracted from the revision


def measure(ns, names, before, before_label) -> None:
    before_env = dict(os.environ, PYTHONPATH=str(before)) if before else None
    t_start = time.perf_counter()
    result = {"targets": TARGETS, "regime": ns.regime, "reps": ns.reps, "block": list(BLOCK), "vocab_size": VOCAB,
              "before": before_label, "layers": {}}
    for name in names:
        layer = ALL_LAYERS[name]
        need, free = estimated_peak(layer), mem_available()
        if need > MEMORY_LIMIT or free < need + 2**30:
            raise SystemExit(f"real_layers.py: {name} needs about {need / 2**30:.1f} GiB (limit "
                             f"{MEMORY_LIMIT / 2**30:.0f}), the machine has {free / 2**30:.1f} GiB available: stopped")
        print(f"{name} ({layer.model}): {layer.parameters() / 1e6:.0f} M parameters, estimated peak "
              f"{need / 2**30:.1f} GiB, available {free / 2**30:.1f} GiB", flush=True)
        entry = {"model": layer.model, "class": layer.classes[1], "dims": layer.dims, "note": layer.note,
                 "parameters": layer.parameters(), "estimated_peak_bytes": need, "mem_available_bytes": free,
                 "measured_at": C.now_iso(), "package_commit": C.git_commit(), "reps": ns.reps}
        check = check_layer(name, ns.regime)
        print(f"  check: bytes identical {check['bytes_identical']}, {check['quantized_weights']} weights, "
              f"{check['differing_bytes']} bytes and {check['differing_scales']} scales differ, control caught "
              f"{check['control']['caught']}, peak bound {check['peak_memory_bound_bytes'] / 2**30:.2f} GiB",
              flush=True)
        entry["check"] = check
        if before_env:
            b = check_layer(name, ns.regime, env=before_env)
            entry["check_before"] = {k: b[k] for k in ("bytes_identical", "quantized_weights", "differing_bytes",
                                                       "differing_scales", "per_tensor", "others_differing", "control")}
            print(f"  check of {before_label}: bytes identical {b['bytes_identical']}, {b['differing_bytes']} bytes "
                  "differ "
                  + ", ".join(f"{n.split('.', 3)[-1]} {t['differing_fraction']:.1%}" for n, t in b["per_tensor"].items()
                              if t["differing_bytes"]), flush=True)
        C.wait_quiet(ns.quiet_wait)
        facts = run_child(["--child", "facts", "--layer", name])
        entry["facts"] = facts["one_thread_ns_per_element"]
        entry["fill_scaling"] = fill_scaling(name, ns.quiet_wait)
        runs = timed_runs(name, ns.regime, ns.reps, ns.quiet_wait)
        entry.update(summary(runs))
        one = timed_runs(name, ns.regime, 1, ns.quiet_wait, ONE_THREAD)
        entry["one_thread"] = one_thread(one, entry)
        entry["timed_fp8_snapshots_equal_checked"] = all(r["files_blake3"] == check["fp8_files_blake3"]
                                                         for r in runs["fp8"])
        timed = [r for rs in (*runs.values(), *one.values()) for r in rs]
        entry["peak_memory_bytes"] = max(check["peak_memory_bound_bytes"],
                                         *(r["process_peak_rss"] + r["tensor_bytes"] for r in timed))
        print(f"  {name}: bf16 {entry['seconds']['bf16']:.3f} s, fp8 {entry['seconds']['fp8']:.3f} s, paired ratio "
              f"{entry['median_paired_time_ratio']}, CPU ns/element {entry['cpu_ns_per_element']}, quantized bytes "
              f"{entry['quantized_bytes_ratio']}", flush=True)
        result["layers"][name] = entry
    if ns.update and Path(ns.result).is_file():
        kept = json.loads(Path(ns.result).read_text())["layers"]
        result["layers"] = {n: result["layers"].get(n, e) for n, e in kept.items()} | {
            n: e for n, e in result["layers"].items() if n not in kept}
        result["updated_layers"] = names
    layers = result["layers"].values()
    result["all_bytes_identical"] = all(e["check"]["bytes_identical"] and e["check"]["declared_equals_quantized"]
                                        and e["check"]["control"]["caught"] and e["timed_fp8_snapshots_equal_checked"]
                                        for e in layers)
    result["median_paired_time_ratio"] = {n: e["median_paired_time_ratio"] for n, e in result["layers"].items()}
    result["met"] = {"time_ratio": all(e["median_paired_time_ratio"] <= 1.15 for e in layers),
                     "quantized_bytes_ratio": all(e["quantized_bytes_ratio"] <= 0.55 for e in layers),
                     "memory_under_10GB": all(e["peak_memory_bytes"] < MEMORY_LIMIT for e in layers)}
    result["bench_seconds"] = round(time.perf_counter() - t_start, 1)
    C.write_result(Path(ns.result), result)
    print(f"wrote {ns.result} ({result['bench_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
