"""The config rule (``models/hf_config.py``): one function for the top level and every sub-config,
checked on stand-in config objects (the framework's serialization is all it reads)."""
from __future__ import annotations

import pytest

from paddle_fullparam_callbacks.config.schema import ConfigError
from paddle_fullparam_callbacks.models.hf_config import check_loadable, describe

GENERIC = {"return_dict": True, "use_cache": False, "tie_word_embeddings": True, "bos_token_id": None,
           "pad_token_id": None, "eos_token_id": None, "tensor_model_parallel_size": 1, "recompute": False,
           "quantization_config": {"weight_quantize_algo": None}, "dtype": None, "paddleformers_version": "1.2.0"}


class PretrainedConfig:
    """Stands in for a framework's generic config: ``to_dict(saving_file=...)`` as PaddleFormers writes it
    (nested configs serialized without saving_file, ``torch_dtype`` as the string of ``dtype``)."""

    model_type = ""

    def __init__(self, **kw):
        self.__dict__.update(GENERIC)
        self.__dict__.update(kw)

    def to_dict(self, saving_file=False):
        out = {k: (v.to_dict() if isinstance(v, PretrainedConfig) else v) for k, v in self.__dict__.items()}
        out["torch_dtype"] = str(out.pop("dtype"))
        out["model_type"] = type(self).model_type
        return out


class TextConfig(PretrainedConfig):
    model_type = "toy_vl_text"


class VisionConfig(PretrainedConfig):
    model_type = "toy_vl"


class ToyVLConfig(PretrainedConfig):
    model_type = "toy_vl"


def toy(**top):
    text = TextConfig(hidden_size=64, hidden_act="silu", return_dict=False, use_cache=False, tensor_model_parallel_size=2,
                      rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "type": "mrope"},
                      rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "type": "mrope"},
                      fuse_rms_norm=False, _attn_implementation="eager")
    vision = VisionConfig(hidden_size=32, hidden_act="gelu_tanh", architectures=["X"], rope_scaling={})
    return ToyVLConfig(text_config=text, vision_config=vision, image_token_id=500, **top)


def test_every_level_gets_the_same_rule():
    out = describe(toy(), tied=False)
    for level in (out, out["text_config"], out["vision_config"]):
        for key in ("torch_dtype", "dtype", "return_dict", "use_cache", "quantization_config", "recompute",
                    "tensor_model_parallel_size", "paddleformers_version", "_attn_implementation"):
            assert key not in level, key
    # the real tie in sub-configs (transformers 5 turns the model's tie on when text_config says so)
    assert out["text_config"]["tie_word_embeddings"] is False and out["vision_config"]["tie_word_embeddings"] is False
    assert "architectures" not in out["vision_config"]
    assert out["vision_config"]["hidden_act"] == "gelu_pytorch_tanh"
    # what the framework reads back on reload stays (PaddleOCR-VL's attention reads rope_scaling)
    assert out["text_config"]["fuse_rms_norm"] is False
    assert out["text_config"]["rope_scaling"] == out["text_config"]["rope_parameters"]
    assert out["text_config"]["model_type"] == "toy_vl_text" and out["image_token_id"] == 500


def test_the_top_level_keeps_what_transformers_reads():
    out = describe(toy(quantization_config={"quant_method": "awq", "bits": 4}))
    assert out["quantization_config"] == {"quant_method": "awq", "bits": 4}
    assert out["tie_word_embeddings"] is True and out["bos_token_id"] is None  # generic keys transformers reads
    assert "return_dict" not in out and "use_cache" not in out


def test_an_architecture_transformers_cannot_load_is_refused_with_the_reason():
    class Ernie4_5_VLMoeConfig(PretrainedConfig):
        model_type = "ernie4_5_moe_vl"

    with pytest.raises(ConfigError, match=r"export.format: Ernie4_5_VLMoeConfig: transformers 5.24 cannot load .*"
                                          r"export.format=paddle_safetensors"):
        check_loadable(Ernie4_5_VLMoeConfig())
    check_loadable(toy())
