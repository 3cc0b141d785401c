"""Issue 5's table of bad inputs (the part that needs Paddle): each gives one clear error naming
its cause, and nothing is written (no snapshot, no staging directory)."""
from __future__ import annotations

import json

import pytest

from paddle_fullparam_callbacks import ConfigError, FullParamExportCallback
from paddle_fullparam_callbacks.cli.demo import TokenDataset, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.config import load_config
from paddle_fullparam_callbacks.export import ExportError, ExportSession
from paddle_fullparam_callbacks.models.model_info import build_model_source

from _helpers import listing

pytestmark = pytest.mark.paddleformers


class NoShardedStateDict:
    config = None


def _export(tmp_path, model, *overrides):
    out = tmp_path / "out"
    cfg = load_config(None, [f"output_dir={out}", *overrides])
    session = ExportSession(cfg, out)
    session.start()
    return session.export(build_model_source(model, cfg), 1)


def _mapping_file(tmp_path, text, suffix=".json"):
    p = tmp_path / f"map{suffix}"
    p.write_text(text)
    return p


CASES = {
    "unknown preset": (lambda t: ["export.aoa=llama_hf"], ConfigError, r"export.aoa: unknown preset 'llama_hf'"),
    "mapping file that does not parse": (
        lambda t: [f"export.aoa={_mapping_file(t, '[not json')}"], ConfigError, r"export.aoa: mapping file .* does not parse"),
    "mapping file of the wrong shape": (
        lambda t: [f"export.aoa={_mapping_file(t, json.dumps({'statements': []}))}"], ConfigError,
        r"must hold a list of statements"),
    "mapping file that does not exist": (
        lambda t: [f"export.aoa={t / 'missing.yaml'}"], ConfigError, r"mapping file .*missing.yaml.* does not exist"),
    "mapping naming a tensor the model lacks": (
        lambda t: ["export.aoa=[\"model.nope.weight -> x.weight\"]"], ExportError, r"export planning failed"),
    "mapping writing one destination twice": (
        lambda t: ["export.aoa=[\"model.norm.weight -> dup.weight\", \"model.embed_tokens.weight -> dup.weight\"]"],
        ExportError, r"the name mapping writes \['dup.weight'\] more than once"),
    "preset of another framework": (lambda t: ["export.aoa=llama_paddlenlp"], ExportError, r"planning failed"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_mapping_inputs(tmp_path, case):
    overrides, exc, message = CASES[case]
    model = make_tiny_llama(seed=1, tie_word_embeddings=False)
    with pytest.raises(exc, match=message):
        _export(tmp_path, model, *overrides(tmp_path))
    out = tmp_path / "out"
    assert not out.exists() or listing(out) == []  # nothing written


def test_model_without_sharded_state_dict(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(TypeError, match=r"NoShardedStateDict has no sharded_state_dict\(\)"):
        build_model_source(NoShardedStateDict(), cfg)


def test_output_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    cfg = load_config(None, [f"output_dir={f}"])
    with pytest.raises(OSError, match=r"output_dir .* is not a directory"):
        ExportSession(cfg, cfg.output_dir).start()
    assert f.read_text() == "" and listing(tmp_path) == ["file"]


def test_tracked_metric_that_never_appears_stops_before_writing(tmp_path):
    out = tmp_path / "snaps"
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out}", "trigger.on_evaluate=true",
                                                  "retention.metric=eval_accuracy"])
    args = trainer_args("paddleformers", str(tmp_path / "t"), 2, evaluation_strategy="steps", eval_steps=2,
                        per_device_eval_batch_size=4, save_steps=100)
    trainer = make_trainer("paddleformers", make_tiny_llama(seed=0), args, [cb], eval_dataset=TokenDataset(n=8, seed=1))
    with pytest.raises(ValueError, match=r"retention.metric 'eval_accuracy' is not in the evaluation results; they have: .*eval_loss"):
        trainer.train()
    assert listing(out) == []


def test_topology_that_does_not_match_the_job(tmp_path):
    # a rank's parameters are slices, but the job has one rank: the plan refuses, naming the tensor
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    model = make_tiny_llama(seed=1)
    real = model.sharded_state_dict

    def sliced():
        sd = dict(real())
        sw = sd["model.norm.weight"]
        sd["model.norm.weight"] = ShardedWeight(sw.key, sw.local_tensor[:32], (32,), sw.global_shape, (0,))
        return sd

    model.sharded_state_dict = sliced
    with pytest.raises(ExportError, match=r"'model.norm.weight': the ranks of the mesh hold 32 of its 64 elements"):
        _export(tmp_path, model)
    assert listing(tmp_path / "out") == []


def test_flattened_shards_are_refused_naming_them(tmp_path):
    # sharding stage 1 v2 / stage 3 with tensor fusion hand out flat 1-D pieces (is_flattened); such
    # a job cannot be built on CPU ranks here, so the model's state dict is made to report them
    model = make_tiny_llama(seed=1)
    sd = model.sharded_state_dict()
    for key in ("model.norm.weight", "lm_head.weight"):
        sd[key].is_flattened = True
    model.sharded_state_dict = lambda: sd
    with pytest.raises(ExportError, match=r"parameter\(s\) \['lm_head.weight', 'model.norm.weight'\] are flattened shards"):
        _export(tmp_path, model)
    assert listing(tmp_path / "out") == []
