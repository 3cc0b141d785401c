"""Models built through paddlefleet: PaddleFormers 1.2's ``Qwen2ForCausalLM.__new__`` (and a dozen
others) returns a paddlefleet ``GPTModel`` carrying the class's mappings and config on the instance
(``models/fleet.py``). paddlefleet is not on PyPI, so the model here is an object of that shape: a
Layer with paddlefleet's parameter names, whose tensors are a real Qwen2's put through the class's
own mapping from Hugging Face (``_gen_aoa_config``, what ``from_pretrained`` does), and the four
instance attributes ``__new__`` sets. Its snapshot must be the pure-Paddle Qwen2's, bit for bit."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.paddleformers

sys.path.insert(0, str(Path(__file__).resolve().parent / "zoo"))

import paddle  # noqa: E402
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight  # noqa: E402
from run_zoo import install_shims  # noqa: E402

from paddle_fullparam_callbacks.assemble import LocalAssembler, build_destination_map, local_shard_info  # noqa: E402
from paddle_fullparam_callbacks.config import ConfigError, load_config  # noqa: E402
from paddle_fullparam_callbacks.export import ExportSession  # noqa: E402
from paddle_fullparam_callbacks.models.mappings.resolve import resolve_mapping  # noqa: E402
from paddle_fullparam_callbacks.models.model_info import build_model_source  # noqa: E402

from _helpers import assert_bitwise_equal, snapshot_tensors  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, fuse_rms_norm=False)


def _whole(tensors: dict) -> dict:
    return {k: ShardedWeight(key=k, local_tensor=t, local_shape=tuple(t.shape), global_shape=tuple(t.shape),
                             global_offset=(0,) * len(t.shape)) for k, t in tensors.items()}


class GPTModel(paddle.nn.Layer):
    """What paddlefleet's GPTModel looks like to the exporter: its own config, its own parameter names."""

    def __init__(self, provider_config, tensors: dict):
        super().__init__()
        self.config = provider_config
        self._tensors = tensors

    def sharded_state_dict(self):
        return _whole(self._tensors)


def _export(model, out):
    cfg = load_config(None, [f"output_dir={out}"])
    session = ExportSession(cfg, out)
    session.start()
    info = session.export(build_model_source(model, cfg), 3, reason="test")
    session.close()
    return info.path


def _fleet_built(reference_snapshot: Path, cls, config) -> GPTModel:
    hf = {k: paddle.to_tensor(v) for k, v in snapshot_tensors(reference_snapshot).items()}
    sd = _whole(hf)
    dmap = build_destination_map(local_shard_info(sd), cls._gen_aoa_config(config))
    fleet = {name: paddle.to_tensor(np.array(t)) for name, t in LocalAssembler(sd, dmap).run(dmap.names)}
    assert "model.embedding.embed_tokens.weight" in fleet and "model.layers.0.self_attn.qkv_proj.weight" in fleet
    model = GPTModel(provider_config=object(), tensors=fleet)
    # what Qwen2ForCausalLM.__new__ sets on the GPTModel it returns
    model._gen_aoa_config = cls._gen_aoa_config
    model._gen_inv_aoa_config = cls._gen_inv_aoa_config
    model.config_to_save = config
    model.is_fleet = True
    return model


def test_a_paddlefleet_built_model_exports_as_its_paddleformers_class(tmp_path):
    install_shims(("gpt_provider",))
    from paddleformers.transformers.qwen2.configuration import Qwen2Config
    from paddleformers.transformers.qwen2.modeling import Qwen2ForCausalLM, Qwen2ForCausalLMDeprecated

    paddle.seed(5)
    config = Qwen2Config(**TINY)
    reference = _export(Qwen2ForCausalLMDeprecated(config), tmp_path / "pure")
    model = _fleet_built(reference, Qwen2ForCausalLM, config)
    shapes = {k: tuple(sw.global_shape) for k, sw in model.sharded_state_dict().items()}
    resolved = resolve_mapping("auto", model, shapes)
    assert resolved.source == "Qwen2ForCausalLM._gen_inv_aoa_config"  # found on the instance
    snapshot = _export(model, tmp_path / "fleet")
    assert_bitwise_equal(snapshot_tensors(snapshot), snapshot_tensors(reference))
    got, want = (json.loads((p / "config.json").read_text()) for p in (snapshot, reference))
    assert got == want and got["architectures"] == ["Qwen2ForCausalLM"] and got["model_type"] == "qwen2"


def test_an_object_without_any_mapping_is_still_refused(tmp_path):
    model = GPTModel(provider_config=object(), tensors={"w": paddle.ones([2, 2])})
    with pytest.raises(ConfigError, match=r"no Hugging Face name mapping is known for .*GPTModel"):
        resolve_mapping("auto", model, {"w": (2, 2)})
