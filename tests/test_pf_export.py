"""Single-process export of a PaddleFormers Llama: bytes, formats, real client, bad input."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.paddleformers


import paddle  # noqa: E402
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama  # noqa: E402
from paddle_fullparam_callbacks.config import ConfigError, load_config  # noqa: E402
from paddle_fullparam_callbacks.export import ExportError, ExportSession, verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.models.model_info import build_model_source  # noqa: E402

from _helpers import (  # noqa: E402
    assert_bitwise_equal, listing, expected_hf_tensors, official_reader_tensors, paddle_logits, run_hf_client,
    snapshot_tensors,
)


def _export(model, out, *overrides, step=1, fn=None):
    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out, fn=fn)
    session.start()
    return session.export(build_model_source(model, cfg), step, reason="test")


def _pf_name(tied):
    # tied or not, PaddleFormers' own mapping writes lm_head.weight (its Phi3 loader needs it;
    # transformers ties a head equal to the embedding)
    return lambda n: n


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bitwise(tmp_path, tied, dtype):
    model = make_tiny_llama(seed=3, tie_word_embeddings=tied)
    info = _export(model, tmp_path, f"export.dtype={'keep' if dtype == 'float32' else dtype}", "export.max_shard_size=150KB")
    assert info.files >= 2  # sharded by size
    assert verify_snapshot(info.path).ok
    got = snapshot_tensors(info.path)
    assert_bitwise_equal(got, expected_hf_tensors(model, _pf_name(tied), lm_head_is_linear=False, dtype=dtype))
    if dtype == "float32":  # the official reader agrees with ours
        official = official_reader_tensors(info.path)
        assert_bitwise_equal(official, got)
    cfg = json.loads((info.path / "config.json").read_text())
    assert cfg["dtype"] == dtype and "torch_dtype" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is tied
    index = json.loads((info.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)


def test_paddle_assembler_gives_identical_bytes(tmp_path):
    model = make_tiny_llama(seed=4, tie_word_embeddings=False)
    a = _export(model, tmp_path / "a", "assembler=builtin")
    b = _export(model, tmp_path / "b", "assembler=paddle")
    ma = json.loads((a.path / "fullparam_manifest.json").read_text())["files"]
    mb = json.loads((b.path / "fullparam_manifest.json").read_text())["files"]
    shards = [f for f in ma if f.endswith(".safetensors")]
    assert shards and all(ma[f]["blake3"] == mb[f]["blake3"] for f in shards)


def test_paddle_safetensors_loads_back_with_set_state_dict(tmp_path):
    model = make_tiny_llama(seed=5)
    info = _export(model, tmp_path, "export.format=paddle_safetensors")
    assert verify_snapshot(info.path).ok
    assert not (info.path / "config.json").exists()
    fresh = make_tiny_llama(seed=99)
    tensors = snapshot_tensors(info.path)
    assert set(tensors) == set(fresh.state_dict())
    fresh.set_state_dict({k: paddle.to_tensor(v) for k, v in tensors.items()})
    for k, v in model.state_dict().items():
        assert np.array_equal(fresh.state_dict()[k].numpy(), v.numpy()), k


def test_callable_exporter_sees_every_full_tensor_and_writes_nothing(tmp_path):
    model = make_tiny_llama(seed=6, tie_word_embeddings=False)
    seen = {}
    info = _export(model, tmp_path, "export.format=callable", "export.callable=os:getcwd",
                   fn=lambda name, t, step: seen.setdefault(name, (tuple(t.shape), step)))
    assert info.path is None
    expected = expected_hf_tensors(model, lambda n: n, lm_head_is_linear=False)
    assert {k: v[0] for k, v in seen.items()} == {k: v.shape for k, v in expected.items()}
    assert {v[1] for v in seen.values()} == {1}
    assert [p for p in os.listdir(tmp_path) if not p.startswith(".")] == []


def test_retention_and_latest(tmp_path):
    model = make_tiny_llama(seed=7)
    cfg = load_config(None, [f"output_dir={tmp_path}", "retention.keep_last=2"])
    session = ExportSession(cfg, tmp_path)
    session.start()
    source = build_model_source(model, cfg)
    for step in (10, 20, 30):
        session.export(source, step)
    names = listing(tmp_path)
    assert names == ["hf-step-000020", "hf-step-000030", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "hf-step-000030"


def _session(out, resume=False):
    cfg = load_config(None, [f"output_dir={out}"])
    session = ExportSession(cfg, out)
    session.start(resume=resume)
    return cfg, session


def test_re_export_of_same_step_replaces_atomically_within_a_run_and_a_resumed_run(tmp_path):
    model = make_tiny_llama(seed=8)
    cfg, session = _session(tmp_path)
    first = session.export(build_model_source(model, cfg), 5)
    with paddle.no_grad():
        for p in model.parameters():
            p.set_value(p + 1.0)
    second = session.export(build_model_source(model, cfg), 5)  # e.g. on_save after every_n_steps
    assert first.path == second.path and verify_snapshot(second.path).ok
    assert listing(tmp_path) == ["hf-step-000005", "latest"]
    run = json.loads((second.path / "fullparam_manifest.json").read_text())["run"]
    assert run["seq"] == 2
    session.close()
    # a job resumed from a checkpoint continues the run: it replaces the step it re-exports
    cfg, resumed = _session(tmp_path, resume=True)
    third = resumed.export(build_model_source(model, cfg), 5)
    assert json.loads((third.path / "fullparam_manifest.json").read_text())["run"] == {"id": run["id"], "seq": 3}
    resumed.close()
    # a new run never replaces another run's snapshot: one clear error, nothing touched
    before = (third.path / "fullparam_manifest.json").read_bytes()
    cfg, fresh = _session(tmp_path)
    with pytest.raises(ExportError, match=rf"holds a snapshot of another run \(run {run['id']}, step 5\)"):
        fresh.export(build_model_source(model, cfg), 5)
    assert (third.path / "fullparam_manifest.json").read_bytes() == before
    assert listing(tmp_path) == ["hf-step-000005", "latest"]


@pytest.mark.hf_client
@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_snapshot_with_same_logits(tmp_path, hf_python, tied):
    model = make_tiny_llama(seed=11, tie_word_embeddings=tied)
    ids = np.random.default_rng(0).integers(0, 512, (2, 24))
    logits = paddle_logits(model, ids)
    info = _export(model, tmp_path / "out", "export.max_shard_size=100KB")
    report = run_hf_client(hf_python, info.path, ids, logits, tmp_path)
    assert report["class"] == "LlamaForCausalLM"
    assert report["missing_keys"] == [] and report["unexpected_keys"] == [] and report["mismatched_keys"] == []
    assert report["max_abs_diff"] <= 1e-4, report


# ---- bad input: one clear error, nothing written ------------------------------------------

def _nothing_written(path):
    return not path.exists() or listing(path) == []


def test_unwritable_output_dir_fails_before_any_byte(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = load_config(None, [f"output_dir={blocker / 'snapshots'}"])
    with pytest.raises(OSError, match="output_dir .* cannot be created"):
        ExportSession(cfg, cfg.output_dir).start()


def test_unknown_preset_is_a_config_error(tmp_path):
    model = make_tiny_llama(seed=1)
    cfg = load_config(None, [f"output_dir={tmp_path}", "export.aoa=no_such_preset"])
    with pytest.raises(ConfigError, match=r"export.aoa: unknown preset 'no_such_preset'"):
        build_model_source(model, cfg)
    assert _nothing_written(tmp_path)


def test_mapping_that_does_not_apply_fails_before_any_byte(tmp_path):
    model = make_tiny_llama(seed=1)
    # a PaddleNLP preset on a PaddleFormers model: its source names do not exist here
    cfg = load_config(None, [f"output_dir={tmp_path}", "export.aoa=llama_paddlenlp"])
    session = ExportSession(cfg, tmp_path)
    session.start()
    with pytest.raises(Exception, match="mapping|llama"):
        session.export(build_model_source(model, cfg), 1)
    assert _nothing_written(tmp_path)


def test_mapping_file_with_split_assembles_each_part(tmp_path):
    model = make_tiny_llama(seed=1, tie_word_embeddings=False)
    mapping = tmp_path / "map.json"
    # only the split parts are exported (the rest, in Paddle's [in, out] layout under its HF name, would be
    # refused: transformers would load those Linear weights transposed)
    mapping.write_text(json.dumps([s for layer in (0, 1) for s in (
        f"model.layers.{layer}.self_attn.q_proj.weight -> qa, model.layers.{layer}.qb, axis=1",
        f"qa -> model.layers.{layer}.self_attn.q_half.weight",
    )] + [f"model.layers.{layer}.{n}.weight -> _" for layer in (0, 1) for n in (
        "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm")] + [f"{n} -> _" for n in (
        "model.embed_tokens.weight", "model.norm.weight")] + ["lm_head.weight -> lm_head.weight"]))
    info = _export(model, tmp_path / "out", f"export.aoa={mapping}")
    got = snapshot_tensors(info.path)
    for layer in (0, 1):
        q = model.state_dict()[f"model.layers.{layer}.self_attn.q_proj.weight"].numpy()
        assert np.array_equal(got[f"model.layers.{layer}.self_attn.q_half.weight"], q[:, : q.shape[1] // 2])
        assert np.array_equal(got[f"model.layers.{layer}.qb"], q[:, q.shape[1] // 2:])


@pytest.mark.parametrize("boxes, message", [
    ([((0, 0), (4, 4))], "is not filled: the mapping covers 16 of 32 elements"),
    ([((0, 0), (4, 8)), ((0, 4), (4, 4))], "is written more than once"),
    ([((0, 0), (4, 6)), ((0, 2), (4, 2))], "is written more than once"),
])
def test_coverage_check_names_the_destination(boxes, message):
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import ShardMappingEntry
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    from paddle_fullparam_callbacks.assemble.mapping import MappingError, _check_coverage

    entries = [
        ShardMappingEntry(ShardedWeightDesc("dst.w", shape, (4, 8), off, "float32"),
                          ShardedWeightDesc("src.w", shape, (4, 8), off, "float32"), None)
        for off, shape in boxes
    ]
    with pytest.raises(MappingError, match=r"destination tensor 'dst.w' \[4, 8\] " + message.split(":")[0]):
        _check_coverage("dst.w", (4, 8), entries)


def test_failed_write_leaves_no_snapshot(tmp_path, monkeypatch):
    from paddle_fullparam_callbacks.export.write import writer as safetensors_io

    model = make_tiny_llama(seed=2)
    calls = {"n": 0}
    real = safetensors_io._pwrite_all

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(safetensors_io, "_pwrite_all", failing)
    with pytest.raises(ExportError, match="No space left on device"):
        _export(model, tmp_path, step=3)
    assert listing(tmp_path) == []


def test_host_arrays_share_parameter_memory():
    # Paddle refuses DLPack on tensors requiring grad; without detach() every parameter was copied
    # (the benchmark measured 0.39 x model bytes of extra RSS before this)
    from paddle_fullparam_callbacks.export.session.host import to_host_array

    model = make_tiny_llama(seed=1)
    p = model.lm_head.weight
    assert not p.stop_gradient
    arr = to_host_array(p)
    assert arr.ctypes.data == p.data_ptr() and arr.shape == tuple(p.shape)
    t = paddle.transpose(model.model.layers[0].mlp.up_proj.weight, [1, 0])
    view = to_host_array(t)
    assert not view.flags.c_contiguous and view.ctypes.data == t.data_ptr()
    b = to_host_array(p.astype("bfloat16"))
    assert b.dtype == np.uint16 and b.shape == tuple(p.shape)


def test_async_export_is_committed_at_interpreter_exit(tmp_path):
    # a background export still pending when the script ends is finished by the atexit hook
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        from paddle_fullparam_callbacks.cli.demo import make_tiny_llama
        from paddle_fullparam_callbacks.config import load_config
        from paddle_fullparam_callbacks.export import ExportSession
        from paddle_fullparam_callbacks.models.model_info import build_model_source
        m = make_tiny_llama(seed=1)
        cfg = load_config(None, ["output_dir={tmp_path}", "export.async_write=true"])
        s = ExportSession(cfg, cfg.output_dir); s.start()
        info = s.export(build_model_source(m, cfg), 9)
        print("PENDING", info.pending)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PENDING True" in out.stdout
    assert verify_snapshot(tmp_path / "hf-step-000009").ok
    assert (tmp_path / "latest").read_text().strip() == "hf-step-000009"


def test_async_ring_is_made_after_the_first_step_not_at_train_begin(tmp_path):
    """Issue 47: Paddle's optimizers create their states at the first step, after on_train_begin; a ring sized
    there from MemAvailable would take memory those states need on a host the model fills. The callback makes
    it at the first on_step_end (from what the training leaves), and the export after it writes the same bytes."""
    from types import SimpleNamespace

    from paddleformers.trainer.trainer_callback import TrainerControl, TrainerState

    from paddle_fullparam_callbacks import FullParamExportCallback

    model = make_tiny_llama(seed=5, tie_word_embeddings=False)
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    cb = FullParamExportCallback(None, output_dir=str(tmp_path / "snaps"), overrides=["export.async_write=true",
                                                                                      "on_error=raise"])
    args, state, control = SimpleNamespace(output_dir=str(tmp_path / "trainer"), sharding=""), TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control, model=model)
    assert cb.session._ring is None and not opt._accumulators  # nothing of either yet
    loss = sum((p * p).sum() for p in model.parameters())  # a step of the real optimizer: its states now exist
    loss.backward()
    opt.step()
    opt.clear_grad()
    assert opt._accumulators
    state.global_step = 1
    cb.on_step_end(args, state, control, model=model)
    ring = cb.session._ring
    assert ring is not None and ring.size == sum(int(p.numel()) * p.element_size() for p in model.parameters())
    cb.on_save(args, state, control, model=model)
    cb.on_train_end(args, state, control, model=model)
    assert cb.session._ring is ring and verify_snapshot(tmp_path / "snaps" / "hf-step-000001").ok
    assert_bitwise_equal(snapshot_tensors(tmp_path / "snaps" / "hf-step-000001"),
                         expected_hf_tensors(model, _pf_name(False), lm_head_is_linear=False, dtype="float32"))
