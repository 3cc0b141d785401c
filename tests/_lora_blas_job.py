"""LoRA exports in a fresh process, for the BLAS-threading and golden-bytes test of ``tests/test_pf_lora.py``.

    OPENBLAS_NUM_THREADS=N python tests/_lora_blas_job.py OUT

Three LoRA models whose every value (base weights, ``lora_A``, ``lora_B``) is set from numpy's seeded generator, so
their inputs are the same on every machine: a PaddleFormers Llama of one layer at hidden 1024, intermediate 2816
(products large enough for OpenBLAS to thread them), r=16 on every linear layer; Ernie 4.5 with fused q/k/v and
up/gate, rslora r=3, alpha=5 (an inexact scaling); a tiny Llama with bfloat16 weights and float32 adapters. Each
is exported merged with its adapter. Prints one JSON line: the snapshots' paths, each tensor's digest
(``_lora_golden.digest``) and the BLAS thread count the process started with.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _helpers import snapshot_tensors  # noqa: E402
from _lora_cases import ADAPTER, export  # noqa: E402
from _lora_golden import digest  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import TINY_LLAMA, make_tiny_llama  # noqa: E402
from paddle_fullparam_callbacks.host import blas  # noqa: E402

ALL = [r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"]


def set_all_values(model, seed: int) -> None:
    """Every parameter := seeded numpy values (normal; 0.05 for lora_B, 0.02 for the rest but norms at 1 + ...)."""
    import paddle

    rng = np.random.default_rng(seed)
    with paddle.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            scale = 0.05 if name.endswith("lora_B") else 0.02
            v = scale * rng.standard_normal(p.shape)
            if "norm" in name:
                v += 1.0
            t = paddle.to_tensor(v.astype(np.float32))
            p.set_value(t.astype(p.dtype) if p.dtype != t.dtype else t)


def models():
    from paddleformers.peft import LoRAConfig, LoRAModel
    from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    base = make_tiny_llama(seed=5, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    yield "llama_1024_r16", LoRAModel(base, LoRAConfig(target_modules=ALL, r=16, lora_alpha=32))
    ernie = Ernie4_5ForCausalLM(Ernie4_5Config(**dict(TINY_LLAMA, fuse_rms_norm=False), head_dim=16))
    yield "ernie_fused_rslora_r3", LoRAModel(ernie, LoRAConfig(target_modules=[r".*\.(qkv|o)_proj", r".*\.(up_gate|down)_proj"],
                                                               r=3, lora_alpha=5, rslora=True))
    bf = make_tiny_llama(seed=5, tie_word_embeddings=False)
    bf.to(dtype="bfloat16")
    yield "llama_bf16_weights_r4", LoRAModel(bf, LoRAConfig(target_modules=ALL, r=4, lora_alpha=8))


def main():
    threads = blas.threads()
    out = {"snapshots": {}, "digests": {}, "blas_threads": threads}
    for i, (name, lm) in enumerate(models()):
        set_all_values(lm, seed=100 + i)
        snap = export(lm, Path(sys.argv[1]) / name, "export.peft_adapter=inside").path
        out["snapshots"][name] = str(snap)
        for where, path in (("", snap), (ADAPTER + "/", snap / ADAPTER)):
            for k, v in sorted(snapshot_tensors(path).items()):
                out["digests"][f"{name}/{where}{k}"] = digest(v)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
