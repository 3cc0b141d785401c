"""A PaddleNLP LoRA run served as adapters (``serve.adapter``) with the real PaddleNLP Trainer and one real vLLM
CPU server (started once for the module, with LoRA and its runtime adapter endpoints, on the Hugging Face base that
``paddle-fullparam convert --as-base`` writes from the base saved in Paddle's format): fused q/k/v and gate/up (one
LoRA layer over each fused weight) with rsLoRA, so the adapter the engine loads is split into the Hugging Face
names, each snapshot loaded while a client naming the adapter never sees a request fail, then the adapter's logprobs
equal transformers' on the merged snapshot; a PiSSA run, whose adapter would apply to a residual base, refused at
start."""
from __future__ import annotations

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.config.schema import ConfigError

from _helpers import AtStep, run_cli
from _lora_cases import set_nonzero_lora
from _vllm import IDS, MODEL, Client, VLLMServer, close, transformers_logprobs

pytestmark = [pytest.mark.paddlenlp, pytest.mark.slow]
FUSED = dict(fuse_attention_qkv=True, fuse_attention_ffn=True)
TARGETS = [r".*\.(qkv|o)_proj", r".*\.(gate_up_fused|down)_proj"]


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """vLLM on the PaddleNLP base (seed 0, fused layers), LoRA up to rank 8. The base is held in Paddle's format only
    (``save_pretrained``: Paddle names, fused weights); ``convert --as-base`` writes the Hugging Face one the engine
    starts on, as docs/serving.md says."""
    tmp = tmp_path_factory.mktemp("engine")
    make_tiny_llama("paddlenlp", seed=0, **MODEL, **FUSED).save_pretrained(str(tmp / "paddle_base"))
    out = run_cli("convert", str(tmp / "paddle_base"), "--output-dir", str(tmp / "base"), "--as-base",
                  f"export.tokenizer={DEMO_TOKENIZER}")
    assert out.returncode == 0, out.stderr
    server = VLLMServer(tmp / "base" / "hf-step-000000", tmp / "vllm.log", lora_rank=8)
    try:
        yield server.wait_ready()
    finally:
        server.kill()


def train(tmp_path, url, lora, steps=6, at=None, overrides=()):
    from paddlenlp.peft import LoRAConfig, LoRAModel

    lm = LoRAModel(make_tiny_llama("paddlenlp", seed=0, **MODEL, **FUSED),
                   LoRAConfig(**{"target_modules": TARGETS, "r": 4, "lora_alpha": 8, **lora}))
    set_nonzero_lora(lm, seed=5)
    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={tmp_path / 'snaps'}", f"serve.url={url}", "serve.adapter=true", "serve.wait=true",
        "trigger.every_n_steps=2", "serve.timeout_s=60", "serve.reload_timeout_s=120",
        f"export.tokenizer={DEMO_TOKENIZER}", *overrides])
    args = trainer_args("paddlenlp", str(tmp_path / "trainer"), steps, save_steps=1000)
    trainer = make_trainer("paddlenlp", lm, args, [])
    attach(trainer, cb)
    if at:
        trainer.add_callback(AtStep(at))
    trainer.train()
    return cb


def test_a_fused_rslora_run_is_served_as_adapters_split_into_hf_names(engine, tmp_path):
    client = {}
    cb = train(tmp_path, engine.url, {"rslora": True, "r": 3, "lora_alpha": 5}, overrides=["serve.keep_adapters=1"],
               at={3: lambda: client.setdefault("c", Client([engine], model="latest"))})
    done = client["c"].finish()
    snaps = tmp_path / "snaps"
    assert [(j.name, j.record["status"]) for j in cb.serving.results] == [(name(s), "ok") for s in (2, 4, 6)]
    assert [d for d in done if d[3]] == [] and len(done) >= 3
    assert engine.adapters() == {"latest": str(snaps / name(6) / "adapter"), name(6): str(snaps / name(6) / "adapter")}
    config = (snaps / name(6) / "adapter" / "adapter_config.json").read_text()
    assert '"use_rslora": true' in config and '"q_proj"' in config and '"gate_proj"' in config  # split into HF names
    expected = transformers_logprobs(snaps / name(6), IDS)
    assert close(engine.prompt_logprobs(IDS, "latest"), expected)
    assert close(engine.prompt_logprobs(IDS, name(6)), expected)
    assert engine.version() == "default" and not close(engine.prompt_logprobs(IDS), expected, 1e-2)


def test_a_pissa_run_is_refused_at_start_naming_why(engine, tmp_path):
    before = engine.adapters()
    with pytest.raises(ConfigError, match=r"^serve.adapter: its adapter cannot be written as a PEFT adapter: PiSSA "
                                          r"layers .*: their adapter applies to the residual base .*; such a run "
                                          r"cannot be served as adapters: serve.adapter=false"):
        train(tmp_path, engine.url, {"pissa": True})
    assert not (tmp_path / "snaps").exists() and engine.adapters() == before  # refused before any engine call
