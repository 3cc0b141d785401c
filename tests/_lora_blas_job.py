"""One LoRA export in a fresh process, for the BLAS-threading test of ``tests/test_pf_lora.py``.

    OPENBLAS_NUM_THREADS=N python tests/_lora_blas_job.py OUT

A PaddleFormers Llama of one layer at hidden 1024, intermediate 2816 (products large enough for OpenBLAS to
thread them), LoRA r=16 on every linear layer, every ``lora_B`` nonzero, exported merged with its adapter.
Prints one JSON line: the snapshot's path and the BLAS thread count the process started with.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lora_cases import export, set_nonzero_lora  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama  # noqa: E402
from paddle_fullparam_callbacks.host import blas  # noqa: E402


def main():
    from paddleformers.peft import LoRAConfig, LoRAModel

    threads = blas.threads()
    base = make_tiny_llama(seed=5, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                           num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    lm = LoRAModel(base, LoRAConfig(target_modules=[r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"], r=16,
                                    lora_alpha=32))
    set_nonzero_lora(lm, seed=2, scale=0.05)
    snap = export(lm, Path(sys.argv[1]), "export.peft_adapter=inside").path
    print(json.dumps({"snapshot": str(snap), "blas_threads": threads}))


if __name__ == "__main__":
    main()
