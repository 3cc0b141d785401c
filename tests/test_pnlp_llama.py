"""PaddleNLP 2.8: the Llama preset (rename + transposes) and the callback in its Trainer."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.paddlenlp

from paddle_fullparam_callbacks import FullParamExportCallback, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args  # noqa: E402
from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.export import ExportSession  # noqa: E402
from paddle_fullparam_callbacks.models.model_info import build_model_source  # noqa: E402

from _helpers import (  # noqa: E402
    assert_bitwise_equal, listing, expected_hf_tensors, paddle_logits, run_hf_client, snapshot_tensors,
)


def _hf_name(n):
    return "model." + n[len("llama."):] if n.startswith("llama.") else n


def _export(model, out, *overrides, step=1):
    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    return session.export(build_model_source(model, cfg), step)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preset_round_trip_bitwise(tmp_path, dtype):
    model = make_tiny_llama("paddlenlp", seed=2)
    info = _export(model, tmp_path, f"export.dtype={'keep' if dtype == 'float32' else dtype}", "export.max_shard_size=100KB")
    assert verify_snapshot(info.path).ok
    got = snapshot_tensors(info.path)
    assert_bitwise_equal(got, expected_hf_tensors(model, _hf_name, lm_head_is_linear=True, dtype=dtype))


@pytest.mark.hf_client
@pytest.mark.parametrize("claims_tied", [False, True])
def test_transformers_loads_paddlenlp_snapshot_with_same_logits(tmp_path, hf_python, claims_tied):
    # PaddleNLP 2.8 accepts tie_word_embeddings=True but keeps a separate LM head: the snapshot
    # must carry lm_head.weight and say tie_word_embeddings=false, or the logits differ
    model = make_tiny_llama("paddlenlp", seed=12, tie_word_embeddings=claims_tied)
    ids = np.random.default_rng(1).integers(0, 512, (2, 20))
    logits = paddle_logits(model, ids)
    info = _export(model, tmp_path / "out")
    assert json.loads((info.path / "config.json").read_text())["tie_word_embeddings"] is False
    report = run_hf_client(hf_python, info.path, ids, logits, tmp_path)
    assert report["missing_keys"] == [] and report["unexpected_keys"] == []
    assert report["max_abs_diff"] <= 1e-4, report


@pytest.mark.slow
def test_callback_in_paddlenlp_trainer(tmp_path):
    out = tmp_path / "snaps"
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out}", "trigger.every_n_steps=5", "retention.keep_last=2"])
    model = make_tiny_llama("paddlenlp", seed=0)
    args = trainer_args("paddlenlp", str(tmp_path / "trainer"), 12, save_steps=6)
    make_trainer("paddlenlp", model, args, [cb]).train()
    # every_n_steps set: the trainer's saves add no snapshots (trigger.on_save unset); the end does
    assert cb.events == ["every_n_steps@5", "every_n_steps@10", "train_end@12"] and cb.errors == []
    assert listing(out) == ["hf-step-000010", "hf-step-000012", "latest"]
    for name in ("hf-step-000010", "hf-step-000012"):
        assert verify_snapshot(out / name).ok
    got = snapshot_tensors(out / "hf-step-000012")
    assert_bitwise_equal(got, expected_hf_tensors(model, _hf_name, lm_head_is_linear=True))


class _Scripted:
    """Rewrites each evaluation's metrics (the dict is shared by the callbacks that follow)."""

    def __init__(self, values):
        self.values, self.n = list(values), 0

    def __getattr__(self, attr):
        if attr.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(attr)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_score"] = self.values[self.n]
        self.n += 1


@pytest.mark.slow
def test_best_by_metric_in_paddlenlp_trainer(tmp_path):
    from paddle_fullparam_callbacks.cli.demo import TokenDataset

    out = tmp_path / "snaps"
    cb = FullParamExportCallback.from_recipe(
        "eval_best", overrides=[f"output_dir={out}", "retention.metric=eval_score", "retention.mode=min",
                                "retention.keep_best=1", "retention.keep_last=1"])
    args = trainer_args("paddlenlp", str(tmp_path / "trainer"), 8, evaluation_strategy="steps", eval_steps=2,
                        per_device_eval_batch_size=4, save_steps=100)
    trainer = make_trainer("paddlenlp", make_tiny_llama("paddlenlp", seed=0), args, [_Scripted([4.0, 2.0, 3.0, 5.0]), cb],
                           eval_dataset=TokenDataset(n=8, seed=1))
    trainer.train()
    assert cb.events == ["evaluate@2", "evaluate@4", "evaluate@6", "evaluate@8"] and cb.errors == []
    assert listing(out) == ["best", "hf-step-000004", "hf-step-000008", "latest"]
    assert (out / "best").read_text().strip() == "hf-step-000004"
    assert verify_snapshot(out / "hf-step-000004").ok


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_layouts_under_tensor_parallelism_follow_paddlenlps_own_split(tp):
    """The global fused tensors of a tensor-parallel PaddleNLP Llama (each rank's slice cut by
    PaddleNLP's own split actions, side by side as sharded_state_dict's offsets describe them) map
    to the same HF q/k/v and gate/up as the single-process tensors."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    from paddle_fullparam_callbacks.assemble.arrays import assemble_destination, region_of
    from paddle_fullparam_callbacks.assemble.mapping import build_destination_map
    from paddle_fullparam_callbacks.models.mappings import PRESETS, MappingContext

    H, inter, heads, kv = 64, 128, 8, 4
    hd = H // heads
    rng = np.random.default_rng(tp)
    ref = {"llama.layers.0.mlp.gate_up_fused_proj.weight": rng.normal(size=(H, 2 * inter)).astype("float32"),
           "llama.layers.0.self_attn.qkv_proj.weight": rng.normal(size=(H, (heads + 2 * kv) * hd)).astype("float32")}
    cfg = LlamaConfig(hidden_size=H, intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv,
                      num_hidden_layers=1, vocab_size=512, fuse_attention_qkv=True, fuse_attention_ffn=True,
                      tensor_parallel_degree=tp)
    glob = {}
    for key, full in ref.items():
        pieces = []
        for r in range(tp):
            cfg.tensor_parallel_rank = r
            split = LlamaForCausalLM._get_tensor_parallel_mappings(cfg, is_split=True).get(key[len("llama."):])
            pieces.append(split(full) if (split is not None and tp > 1) else full)
        glob[key] = np.concatenate(pieces, axis=1)
    ctx = MappingContext({"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv}, False,
                         {k: v.shape for k, v in glob.items()}, {"tensor_parallel_degree": tp})
    stmts = [s for s in PRESETS["llama_paddlenlp"].statements(ctx) if "gate_up" in s or "qkv" in s or "__tmp__" in s]
    info = {k: [ShardedWeightDesc(k, v.shape, v.shape, (0, 0), "float32")] for k, v in glob.items()}
    dmap = build_destination_map(info, {"aoa_statements": stmts})
    got = {n: assemble_destination(dmap.entries[n], dmap.spec_by_name[n].dtype,
                                   lambda d: (region_of(glob[d.key], d.global_offset, d.local_shape), "float32"))[0]
           for n in dmap.names}
    gu = ref["llama.layers.0.mlp.gate_up_fused_proj.weight"]
    per_group = ref["llama.layers.0.self_attn.qkv_proj.weight"].reshape(H, kv, heads // kv + 2, hd)  # PaddleNLP's forward
    want = {"mlp.gate_proj": gu[:, :inter].T, "mlp.up_proj": gu[:, inter:].T,
            "self_attn.q_proj": per_group[:, :, : heads // kv].reshape(H, -1).T,
            "self_attn.k_proj": per_group[:, :, -2].reshape(H, -1).T, "self_attn.v_proj": per_group[:, :, -1].reshape(H, -1).T}
    assert sorted(got) == sorted(f"model.layers.0.{k}.weight" for k in want)
    for k, v in want.items():
        assert np.array_equal(got[f"model.layers.0.{k}.weight"], v), k
