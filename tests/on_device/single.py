"""One process with its parameters on the fake accelerator (``fakedev:0``): exports of the real
framework models, each measured against the device budget and compared with the same export from
CPU tensors.

    python single.py --framework paddleformers|paddlenlp --out DIR     (environment: tests/_fake_device.device_env)

Cases (one process, so Paddle and the frameworks are imported once):

- ``llama``: an untied Llama (embedding and LM head 128 KB each), budget 16 KB: ``keep``; ``bfloat16``
  (the cast runs on the device in 16 KB chunks); ``bfloat16`` with budget 0 (the cast runs on the host);
- ``llama_staged``: ``bfloat16`` again, in 4 KB chunks, each through a reused host staging buffer (the path of
  CUDA builds, with pinned memory there);
- ``llama_chunks``: ``keep`` copied in 4 KB chunks through the staging buffer (without one, a ``keep`` slice
  leaves the device in one copy): every tensor of more than 4 KB leaves the device as many views at
  growing offsets;
- ``tied``: a tied Llama, budget 16 KB;
- ``lora``: a LoRA model with nonzero adapters, merged, with its PEFT adapter, budget 16 KB;
- ``no_transpose``: ``bfloat16``, budget 16 KB, on a device whose ``contiguous`` fails (the kernel made to
  refuse, as the plugin without its kernels does): the transposes fall back to the host;
- ``slow_transposes``: a background export (``export.async_write``) on a device whose ``contiguous`` takes
  5 ms a call (slower than its copies to the host), judged on the second weight (``TIMED_BYTES`` 1): the
  first two Linear weights are transposed on the device, then the host's writer threads transpose the rest;
- ``mixed``: the llama with its first decoder layer and its LM head moved to the CPU (offloaded);
- ``fp8``, ``lora_fp8``, ``fp8_async``: ``export.quantization=fp8`` of the llama (``bfloat16``), of the LoRA
  model (merged, then quantized; its PEFT adapter) and of the llama in a background export.

The process runs with the plugin's ``contiguous`` kernel (``device_env(kernels=True)``): the Linear
weights are transposed on the device where the budget allows, and each export reports how often the
kernel ran (``contiguous_calls``) and the boundary's own count of device transposes.

Every export is done three times with the same weights: all parameters on the device, the ``mixed``
placement, all on the CPU; the tensor files must be identical bytes. For each device export the peak
of Paddle's allocator statistics minus the allocation before it is reported (``device_peak``), and the
ops that failed on the device, if any. Prints ``ONDEVICE {json}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

DEVICE = "fakedev:0"
FP8 = ["export.quantization=fp8", "export.quantization_block=[32,48]"]  # partial edge blocks: 64 = 48 + 16


def export(model, out: Path, overrides) -> dict:
    """One snapshot; the device's allocation peak during it (Paddle's statistics), the device's contiguous
    kernel calls and transposes, and the files' digests."""
    import paddle

    import _fake_device as fd
    from paddle_fullparam_callbacks.assemble import device

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.export.session.host import HostRing
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}", "on_error=raise", "export.max_shard_size=100KB", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    try:
        paddle.device.synchronize()
        paddle.device.reset_max_memory_allocated(DEVICE)
        before, calls = paddle.device.memory_allocated(DEVICE), fd.contiguous_calls()[0]
        transposes = []
        real = device.DeviceBoundary._transposed_out

        def counted(self, *a):
            out = real(self, *a)
            transposes.append(out is not None)
            return out

        copies = []  # per slice copied out as it is (not transposed on the device): the copies off the device
        real_copy_out = device.DeviceBoundary._copy_out

        def copy_out(self, *a):
            before_copies = self.stats.d2h_copies
            real_copy_out(self, *a)
            copies.append(self.stats.d2h_copies - before_copies)

        device.DeviceBoundary._transposed_out, device.DeviceBoundary._copy_out = counted, copy_out
        ring = {"arrays": 0, "copies": 0}  # background exports: slices put in the ring by the boundary, copied in
        real_array, real_copy = HostRing.array, HostRing.copy_in

        def array(self, *a):
            got = real_array(self, *a)
            ring["arrays"] += got is not None
            return got

        def copy_in(self, *a, **kw):
            ring["copies"] += 1
            return real_copy(self, *a, **kw)

        HostRing.array, HostRing.copy_in = array, copy_in
        try:
            source = build_model_source(model, cfg)
            session.prepare(source)  # the plan, and a background export's ring (the callback makes that after the first step)
            info = session.export(source, 1, reason="test")
            info = session.wait_pending() or info  # a background export: its final record
        finally:
            device.DeviceBoundary._transposed_out, device.DeviceBoundary._copy_out = real, real_copy_out
            HostRing.array, HostRing.copy_in = real_array, real_copy
        peak = paddle.device.max_memory_allocated(DEVICE) - before
        calls = fd.contiguous_calls()[0] - calls
    finally:
        session.close()
    files = {}
    for f in sorted(info.path.rglob("*.safetensors")):
        files[str(f.relative_to(info.path))] = hashlib.sha256(f.read_bytes()).hexdigest()
    index = info.path / "model.safetensors.index.json"
    return {"device_peak": peak, "files": files, "index": json.loads(index.read_text())["weight_map"],
            "timings": info.timings, "path": str(info.path), "contiguous_calls": calls,
            "device_transposes": sum(transposes), "transposes_asked": len(transposes), "ring": ring,
            "copies_per_slice": sorted(set(copies))}


def place(model, where: str) -> None:
    """All parameters on ``where`` ('device' or 'cpu'), or 'mixed': the device, except the first decoder
    layer and the LM head, moved to the CPU as an offloading job would."""
    model.to(device=DEVICE if where in ("device", "mixed") else "cpu")
    if where == "mixed":
        subs = dict(model.named_sublayers())
        first_layer = next(layer for name, layer in subs.items() if name.endswith("layers.0"))
        head = next(layer for name, layer in subs.items() if name.endswith("lm_head"))
        first_layer.to(device="cpu")
        head.to(device="cpu")


def places(model) -> dict:
    out = {}
    for _, p in model.named_parameters():
        out[str(p.place)] = out.get(str(p.place), 0) + 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", required=True)
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    import paddle

    from _lora_cases import set_nonzero_lora
    from paddle_fullparam_callbacks.cli.demo import make_tiny_llama

    paddle.set_device(DEVICE)
    out = Path(ns.out)
    peft = __import__(f"{ns.framework}.peft", fromlist=["LoRAConfig", "LoRAModel"])
    lora = peft.LoRAModel(make_tiny_llama(ns.framework, seed=4, tie_word_embeddings=False),
                          peft.LoRAConfig(target_modules=[r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"],
                                          r=4, lora_alpha=8))
    set_nonzero_lora(lora, seed=2)
    models = {"llama": make_tiny_llama(ns.framework, seed=1, tie_word_embeddings=False),
              "tied": make_tiny_llama(ns.framework, seed=2, tie_word_embeddings=True), "lora": lora}
    budget = "export.device_memory_budget=16KB"
    cases = {
        "llama": ("llama", [budget]),
        "llama_bf16": ("llama", [budget, "export.dtype=bfloat16"]),
        "llama_bf16_budget0": ("llama", ["export.device_memory_budget=0", "export.dtype=bfloat16"]),
        "llama_staged": ("llama", [budget, "export.dtype=bfloat16"]),  # through a reused staging buffer
        "llama_chunks": ("llama", [budget]),  # 4 KB staged chunks: a tensor is many views at growing offsets
        "tied": ("tied", [budget]),
        "lora": ("lora", [budget, "export.peft_adapter=inside"]),
        "no_transpose": ("llama", [budget, "export.dtype=bfloat16"]),  # contiguous refused on the device
        "llama_async": ("llama", [budget, "export.async_write=true"]),  # device -> the staging ring, once
        "slow_transposes": ("llama", [budget, "export.async_write=true"]),  # contiguous slower than the copies
        # FP8 (export.quantization): quantized on the host from the bfloat16 cast (made on the device where the
        # budget allows); a LoRA model merged, then quantized, its PEFT adapter as it is; a background export
        "fp8": ("llama", [budget, "export.dtype=bfloat16", *FP8]),
        "lora_fp8": ("lora", [budget, "export.peft_adapter=inside", *FP8]),
        "fp8_async": ("llama", [budget, "export.dtype=bfloat16", "export.async_write=true", *FP8]),
    }
    report = {"framework": ns.framework, "cases": {}}
    from paddle_fullparam_callbacks.assemble import device
    from paddle_fullparam_callbacks.host.poison import poisoned

    staged = [0]  # chunks that went through a staging buffer
    original = device.DeviceBoundary.staging_buffer

    def counting(self, nbytes):
        buf = original(self, nbytes)
        staged[0] += buf is not None
        return buf

    device.DeviceBoundary.staging_buffer = counting
    for case, (model_name, overrides) in cases.items():
        model = models[model_name]
        device.DEFAULT_STAGING = "host" if case in ("llama_staged", "llama_chunks") else "auto"
        # 4100 bytes (1025 float32 elements): chunks that divide no tensor, a tensor many views at growing offsets
        device.CHUNK_BYTES = 4100 if case in ("llama_staged", "llama_chunks") else 16 * 2**20
        device.TIMED_BYTES = 1 if case == "slow_transposes" else 8 * 2**20  # the verdict on the second weight
        real_contiguous = paddle.Tensor.contiguous
        if case == "no_transpose":
            def refused(self):
                raise RuntimeError("(NotFound) The kernel `contiguous` is not registered (test)")

            paddle.Tensor.contiguous = refused
        elif case == "slow_transposes":
            def slow(self, real=real_contiguous):
                time.sleep(0.005)
                return real(self)

            paddle.Tensor.contiguous = slow
        runs = {}
        for where in ("device", "mixed", "cpu"):
            place(model, where)
            staged[0] = 0
            try:
                with poisoned(len(report["cases"])):  # host buffers hold a pattern until written (issue 46)
                    runs[where] = {"places": places(model), **export(model, out / case / where, overrides),
                                   "staged_chunks": staged[0]}
            except Exception as e:  # reported, with what failed on the device
                runs[where] = {"places": places(model), "error": f"{type(e).__name__}: {e}"[:2000]}
        paddle.Tensor.contiguous = real_contiguous
        device._NO_TRANSPOSE.clear()  # the refusal is remembered per device type: not beyond this case
        report["cases"][case] = runs
    print("ONDEVICE " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
