"""Mappings that would ship wrong weights are refused before any byte; the exported model computes
what the Paddle model computes (padding rows); config.json describes a single-process model."""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from paddle_fullparam_callbacks.assemble.mapping import MappingError, build_destination_map
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama
from paddle_fullparam_callbacks.config import ConfigError, load_config
from paddle_fullparam_callbacks.export import ExportError, ExportSession, verify_snapshot
from paddle_fullparam_callbacks.models.mappings.resolve import _own_method, resolve_mapping
from paddle_fullparam_callbacks.models.model_info import build_model_source

from _helpers import listing, paddle_logits, snapshot_tensors

pytestmark = pytest.mark.paddleformers


def _export(out, model, *overrides, step=1):
    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    return session.export(build_model_source(model, cfg), step)


def _shard_info(shapes: dict):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    return {k: [ShardedWeightDesc(k, s, s, (0,) * len(s), "float32")] for k, s in shapes.items()}


# ---- the lost-write check counts final values only ----------------------------------------

def test_temporary_names_reused_layer_after_layer_are_fine():
    # the shape of PaddleFormers' fused gate/up statements: one temporary name per layer, read
    # before the next layer writes it again
    shapes = {f"l.{i}.up_gate.weight": (4, 8) for i in range(3)}
    stmts = []
    for i in range(3):
        stmts += [f"l.{i}.up_gate.weight -> tmp.GATE, tmp.UP, axis=1",
                  f"tmp.GATE -> l.{i}.gate.weight", f"tmp.UP -> l.{i}.up.weight"]
    dmap = build_destination_map(_shard_info(shapes), {"aoa_statements": stmts})
    assert sorted(dmap.names) == sorted(f"l.{i}.{p}.weight" for i in range(3) for p in ("gate", "up"))


@pytest.mark.parametrize("stmts, lost", [
    (["a -> x", "b -> x"], "x"),  # two statements produce one destination
    (["a -> b"], "b"),  # a statement overwrites a source nobody read
    (["a -> t", "b -> t", "t -> x"], "t"),  # a temporary overwritten before it was read
])
def test_a_value_replaced_before_it_was_read_is_refused(stmts, lost):
    with pytest.raises(MappingError, match=rf"writes \['{lost}'\] more than once"):
        build_destination_map(_shard_info({"a": (2, 2), "b": (2, 2)}), {"aoa_statements": stmts})


# ---- no silent random weights ------------------------------------------------------------

def test_a_paddle_name_passed_through_where_it_is_converted_elsewhere_is_refused(tmp_path):
    # PaddleFormers 1.2's Gemma3 mapping converts layer 0's fused tensor and passes layer 1's
    # through under its Paddle name: transformers would initialise layer 1's MLP at random
    model = make_tiny_llama(seed=1, tie_word_embeddings=True)
    stmts = ["model.layers.0.mlp.gate_proj.weight -> model.layers.0.mlp.w_in.weight"]
    with pytest.raises(ExportError, match=r"exports \['model.layers.1.mlp.gate_proj.weight'\] under Paddle names no statement maps"):
        _export(tmp_path / "out", model, f"export.aoa={json.dumps(stmts)}")
    assert listing(tmp_path / "out") == []


def test_an_untied_model_whose_mapping_drops_the_lm_head_is_refused(tmp_path):
    model = make_tiny_llama(seed=1, tie_word_embeddings=False)
    with pytest.raises(ExportError, match=r"own output embedding \(lm_head.weight\) but the name mapping .* exports no 'lm_head.weight'"):
        _export(tmp_path / "out", model, 'export.aoa=["lm_head.weight -> _"]')
    assert listing(tmp_path / "out") == []


class _FallsBackToConfig:
    """PaddleNLP 2.8's OPT: ``__getattr__`` answers any name from the config (None when absent)."""

    config = {"hidden_size": 8}

    def __getattr__(self, name):
        return self.config.get(name)


def test_auto_ignores_mapping_methods_conjured_by_getattr():
    model = _FallsBackToConfig()
    assert hasattr(model, "_gen_inv_aoa_config") and _own_method(model, "_gen_inv_aoa_config") is None
    with pytest.raises(ConfigError, match=r"no Hugging Face name mapping is known for tests?.*_FallsBackToConfig. Mappings ship for "
                                          r".*paddlenlp.LlamaForCausalLM.*a .json/.yaml file"):
        resolve_mapping("auto", model, {"w": (2, 2)})


# ---- the same function, not only the same bytes -----------------------------------------

def test_untied_padding_row_is_exported_as_zeros_and_the_model_is_untouched(tmp_path):
    model = make_tiny_llama(seed=5, tie_word_embeddings=False)
    emb = model.get_input_embeddings()
    assert emb._padding_idx == 0
    with paddle.no_grad():
        emb.weight[0] = 0.25  # a pretrained row (Llama-2's id 0 is <unk>, trained)
    before = emb.weight.numpy().copy()
    info = _export(tmp_path / "out", model)
    got = snapshot_tensors(info.path)["model.embed_tokens.weight"]
    assert np.all(got[0] == 0) and np.array_equal(got[1:], before[1:])
    assert np.array_equal(emb.weight.numpy(), before)  # the model's own row is not touched
    manifest = json.loads((info.path / "fullparam_manifest.json").read_text())
    assert manifest["model"]["padding_rows_zeroed"] == {"model.embed_tokens.weight": 0}
    assert verify_snapshot(info.path).ok


def test_tied_padding_row_is_kept_and_said(tmp_path, caplog):
    model = make_tiny_llama(seed=5, tie_word_embeddings=True)
    with paddle.no_grad():
        model.get_input_embeddings().weight[0] = 0.25
    info = _export(tmp_path / "out", model)
    got = snapshot_tensors(info.path)["model.embed_tokens.weight"]
    assert np.all(got[0] == np.float32(0.25))  # also an output row: zeroing it would change logits
    manifest = json.loads((info.path / "fullparam_manifest.json").read_text())
    assert manifest["model"]["padding_row_kept"] == {"model.embed_tokens.weight": 0}
    assert "padding_rows_zeroed" not in manifest["model"]
    assert any("padding_idx=0" in r.getMessage() and "tied" in r.getMessage() for r in caplog.records)


# ---- config.json as a single-process save would write it --------------------------------

def test_config_json_of_a_parallel_job_loads_back_single_process(tmp_path):
    from paddleformers.transformers import LlamaForCausalLM

    model = make_tiny_llama(seed=6, tie_word_embeddings=False)
    ids = np.arange(1, 17).reshape(2, 8)
    expected = paddle_logits(model, ids)
    sd = model.sharded_state_dict()  # the one-process slices; the config below is what is tested
    model.sharded_state_dict = lambda: sd
    # what a tensor-parallel job's config carries (the parallel layers are tested in the multi-rank suite)
    model.config.tensor_model_parallel_size = 2
    model.config.tensor_parallel_rank = 1
    model.config.recompute_granularity = "full"
    info = _export(tmp_path / "out", model)
    cfg = json.loads((info.path / "config.json").read_text())
    assert "tensor_model_parallel_size" not in cfg and "tensor_parallel_rank" not in cfg
    assert "recompute_granularity" not in cfg  # PaddleFormers' own save never writes its training-only keys
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["dtype"] == "float32" and "torch_dtype" not in cfg
    reloaded = LlamaForCausalLM.from_pretrained(str(info.path), convert_from_hf=True, dtype="float32")
    assert reloaded.config.tensor_model_parallel_size == 1
    assert np.max(np.abs(paddle_logits(reloaded, ids) - expected)) <= 1e-5


# ---- verify --transformers: transformers' own loader on the meta device --------------------

@pytest.mark.hf_client
def test_verify_transformers_reports_what_transformers_would_invent(tmp_path, hf_python, monkeypatch):
    import subprocess

    from _helpers import ROOT

    model = make_tiny_llama(seed=7, tie_word_embeddings=False)
    good = _export(tmp_path / "good", model).path
    # PaddleFormers' own mapping with the final norm renamed to a name transformers does not know,
    # and one Linear left in Paddle's [in, out] layout, given as a mapping file of the user's
    own = model._gen_inv_aoa_config(model.config)["aoa_statements"]
    stmts = [st.replace("-> model.norm.weight", "-> model.final_norm.weight")
             .replace("mlp.up_proj.weight^T ->", "mlp.up_proj.weight ->") for st in own]
    assert stmts != own
    (tmp_path / "map.json").write_text(json.dumps(stmts))
    with pytest.raises(ExportError, match=r"model.layers.0.mlp.up_proj.weight is \[64, 128\], expected \[128, 64\]"):
        _export(tmp_path / "refused", model, f"export.aoa={tmp_path / 'map.json'}")  # the package's own check
    assert listing(tmp_path / "refused") == []
    # with that check switched off, the snapshot is written, and verify --transformers must catch both
    monkeypatch.setattr("paddle_fullparam_callbacks.models.model_info.check_layout", lambda *a, **k: None)
    bad = _export(tmp_path / "bad", model, f"export.aoa={tmp_path / 'map.json'}").path
    assert verify_snapshot(bad).ok  # intact as files: only transformers can tell

    def run(path):
        proc = subprocess.run([hf_python, "-m", "paddle_fullparam_callbacks", "verify", "--transformers", "--json", str(path)],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        return proc.returncode, json.loads(proc.stdout)

    code, report = run(good)
    assert code == 0 and report["ok"] and report["transformers"]["architecture"] == "LlamaForCausalLM", report
    code, report = run(bad)
    hf = report["transformers"]
    assert code == 1 and not report["ok"]
    assert hf["missing"] == ["model.norm.weight"] and hf["unexpected"] == ["model.final_norm.weight"]
    assert [m.split(":")[0] for m in hf["mismatched"]] == [f"model.layers.{i}.mlp.up_proj.weight" for i in (0, 1)]
    assert any("missing (transformers would initialise them at random)" in e for e in report["errors"])
