"""PaddleNLP 2.8.1 Llama under tensor parallelism: sharded state dicts that contradict their layers.

PaddleNLP's ``LlamaLMHead`` holds ``[hidden, vocab / tp]`` on every mp rank (``is_distributed``,
``split_axis=1``) but Paddle's generic ``Layer.sharded_state_dict`` reports it as a whole
``[hidden, vocab / tp]`` tensor at ``[0, 0]``: without ``shard_fixes`` every tensor-parallel export
refuses ("replicas out of sync").

* The rule, without processes: ``resolve_shard`` (pure) and ``fix_sharded_state_dict`` on live layers.
* The real model (``tests/multirank/pnlp_tp_job.py``): PaddleNLP's ``LlamaForCausalLM`` built for
  mp2 (2 ranks), mp4 and dp2 x mp2 (4 ranks), and its ``LlamaForCausalLMPipe`` for pp2 x mp2, fused
  and unfused q/k/v and gate/up; each rank's weights are PaddleNLP's own split of a seeded
  single-process weight, changed before each of two exports fired through the callback. Every
  snapshot equals, bit for bit, the Hugging Face tensors of a single-process PaddleNLP Llama holding
  the same weights (split and transposed here by hand), and transformers' logits on ids with the
  special ids match that model's within 1e-4.

Fused layouts on a mesh also prove that ``MeshAssembler`` frees a received slice only after every
destination that reads it (a fused q/k/v or gate/up destination has several entries on one slice).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import harness  # noqa: E402
import pnlp_tp_job as job  # noqa: E402

from _helpers import paddle_logits, run_hf_client, snapshot_tensors  # noqa: E402
from paddle_fullparam_callbacks import verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.models.shard_fixes import ShardLayoutError, fix_sharded_state_dict, framework_split_axes, resolve_shard

pytestmark = pytest.mark.paddlenlp

LM = "lm_head.weight"
HEAD_MARKS = {"layer LlamaLMHead": 1}


# ---- the rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("mp_rank", [0, 1, 3])
def test_a_distributed_parameter_reported_whole_is_corrected(mp_rank):
    fix = resolve_shard(LM, (64, 32), (64, 32), (0, 0), True, 1, mp_rank, 4, layer_axes=HEAD_MARKS,
                        framework_axes={"paddlenlp split action (is_column=True)": 1},
                        degrees={"layer LlamaLMHead config.tensor_parallel_degree": 4})
    assert (fix.global_shape, fix.global_offset, fix.axis) == ((64, 128), (0, 32 * mp_rank), 1)
    assert fix.describe().startswith(
        "parameter 'lm_head.weight': sharded_state_dict says global [64, 32] at [0, 0] on every mp rank, "
        "but the parameter is split over 4 ranks along axis 1 (is_distributed=True; split_axis=1; "
        "layer LlamaLMHead: axis 1; paddlenlp split action (is_column=True): axis 1): exported as global [64, 128]")


def test_the_axis_comes_from_any_mark_and_a_wrong_offset_is_corrected():
    # the layer class alone (no split_axis attribute) proves the axis
    assert resolve_shard("e.weight", (16, 8), (16, 8), (0, 0), True, None, 1, 2,
                         layer_axes={"layer VocabParallelEmbedding": 0}).global_offset == (16, 0)
    # the framework's split action alone
    assert resolve_shard("w", (8, 4), (8, 4), (0, 0), True, None, 1, 2,
                         framework_axes={"paddlenlp split action (is_column=True)": 1}).global_shape == (8, 8)
    # the right global shape at a wrong offset (rank 1 claims rank 0's block)
    fix = resolve_shard("w", (8, 4), (8, 8), (0, 0), True, 1, 1, 2)
    assert (fix.global_shape, fix.global_offset) == ((8, 8), (0, 4))
    # negative axes (a 1-D bias split on its last axis)
    assert resolve_shard("b", (4,), (4,), (0,), True, -1, 1, 2).global_offset == (4,)


@pytest.mark.parametrize("case", [
    dict(is_distributed=False, split_axis=1),  # not marked distributed: a replica
    dict(mp_degree=1),  # no tensor parallelism
    dict(split_axis=None, layer_axes={}),  # is_distributed alone (expert-parallel experts are marked so)
    dict(global_shape=(64, 128), offset=(0, 64)),  # already right
])
def test_entries_that_do_not_contradict_their_layer_stand(case):
    args = dict(local=(64, 64), global_shape=(64, 64), offset=(0, 0), is_distributed=True, split_axis=1,
                mp_rank=1, mp_degree=2, layer_axes=HEAD_MARKS)
    args.update(case)
    assert resolve_shard(LM, args["local"], args["global_shape"], args["offset"], args["is_distributed"],
                         args["split_axis"], args["mp_rank"], args["mp_degree"], layer_axes=args["layer_axes"]) is None


@pytest.mark.parametrize("kwargs, why", [
    (dict(split_axis=0), "the marks disagree on the split axis, so its global shape cannot be known"),
    (dict(framework_axes={"paddlenlp split action (is_column=False)": 0}), "the marks disagree on the split axis"),
    (dict(degrees={"layer LlamaLMHead config.tensor_parallel_degree": 4}),
     "layer LlamaLMHead config.tensor_parallel_degree says 4 ranks, the model-parallel group has 2"),
    (dict(global_shape=(64, 256)), "along axis 1 that makes global [64, 128] at [0, 0], and the dict's global shape is "
                                   "neither that nor the local shape"),
    (dict(split_axis=2), "split_axis=2 names an axis outside the 2-d tensor"),
])
def test_contradictions_that_cannot_be_resolved_are_refused_naming_the_parameter(kwargs, why):
    args = dict(global_shape=(64, 64), split_axis=1, layer_axes=HEAD_MARKS)
    args.update(kwargs)
    with pytest.raises(ShardLayoutError) as e:
        resolve_shard(LM, (64, 64), args.pop("global_shape"), (0, 0), True, args.pop("split_axis"), 0, 2, **args)
    msg = str(e.value)
    assert msg.startswith("parameter 'lm_head.weight': sharded_state_dict says global "), msg
    assert "but the parameter is split over 2 ranks (" in msg, msg
    assert why in msg and msg.endswith("; refusing to export it"), msg


def test_the_thin_layer_reads_the_live_parameters_and_copies_entries():
    from paddle import nn
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import make_replicated_sharded_weight

    class ColumnParallelLinear(nn.Layer):  # a user class with Paddle's name proves nothing
        def __init__(self):
            super().__init__()
            self.weight = self.create_parameter([4, 3])

    class Model(nn.Layer):
        def __init__(self):
            super().__init__()
            self.head = ColumnParallelLinear()
            self.norm = nn.LayerNorm(4)
            self.head.weight.is_distributed = True

    m = Model()
    sd = {k: make_replicated_sharded_weight(k, p) for k, p in m.state_dict().items()}
    # marked distributed, but nothing says along which axis: left alone
    assert fix_sharded_state_dict(m, sd, 1, 2)[1] == []
    m.head.weight.split_axis = 1
    fixed, fixes = fix_sharded_state_dict(m, sd, 1, 2)
    assert [f.key for f in fixes] == ["head.weight"] and fixes[0].evidence == ("is_distributed=True", "split_axis=1")
    assert (tuple(fixed["head.weight"].global_shape), tuple(fixed["head.weight"].global_offset)) == ((4, 6), (0, 3))
    assert fixed["head.weight"].local_tensor is m.head.weight
    assert tuple(sd["head.weight"].global_shape) == (4, 3)  # the model's own entries are not changed
    assert fixed["norm.weight"] is sd["norm.weight"]
    assert fix_sharded_state_dict(m, sd)[1] == []  # no fleet: an mp group of one


def test_paddlenlp_split_actions_name_the_axis():
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    m = LlamaForCausalLM(LlamaConfig(**job.config_kwargs("unfused")))
    assert framework_split_axes(m)(LM, 2) is None  # one process: no actions
    m.config.tensor_parallel_degree, m.config.tensor_parallel_rank = 2, 0
    lookup = framework_split_axes(m)
    got = {k: lookup(k, 2) for k in (LM, "llama.embed_tokens.weight", "llama.layers.1.self_attn.q_proj.weight",
                                     "llama.layers.1.self_attn.o_proj.weight", "llama.norm.weight")}
    assert got == {LM: ("paddlenlp split action (is_column=True)", 1),
                   "llama.embed_tokens.weight": ("paddlenlp split action (is_column=False)", 0),
                   "llama.layers.1.self_attn.q_proj.weight": ("paddlenlp split action (is_column=True)", 1),
                   "llama.layers.1.self_attn.o_proj.weight": ("paddlenlp split action (is_column=False)", 0),
                   "llama.norm.weight": None}


# ---- the real model on real ranks ------------------------------------------------------------

def expected_hf(variant: str, step: int, shapes: dict) -> dict:
    """The single-process weights in Hugging Face names and layouts, split and transposed by hand
    (PaddleNLP's forward: fused q/k/v columns are, per key-value group, its query heads, then its key
    head, then its value head; fused gate/up is [gate, up]; Linear weights are [in, out])."""
    kw = job.config_kwargs(variant)
    H, heads, kv, inter = kw["hidden_size"], kw["num_attention_heads"], kw["num_key_value_heads"], kw["intermediate_size"]
    hd, groups = H // heads, heads // kv
    out = {}
    for name, shape in shapes.items():
        w = job.weight_values(name, shape, step)
        hf = "model." + name[len("llama."):] if name.startswith("llama.") else name
        if name.endswith("qkv_proj.weight"):
            t = w.reshape(H, kv, groups + 2, hd)
            base = hf[: -len("qkv_proj.weight")]
            out[base + "q_proj.weight"] = t[:, :, :groups].reshape(H, -1).T
            out[base + "k_proj.weight"] = t[:, :, groups].reshape(H, -1).T
            out[base + "v_proj.weight"] = t[:, :, groups + 1].reshape(H, -1).T
        elif name.endswith("gate_up_fused_proj.weight"):
            base = hf[: -len("gate_up_fused_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w[:, :inter].T, w[:, inter:].T
        elif w.ndim == 2 and "embed_tokens" not in name:
            out[hf] = w.T
        else:
            out[hf] = w
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def single_process_logits(variant: str, step: int, ids: np.ndarray) -> np.ndarray:
    """Logits of a one-process PaddleNLP Llama holding the same weights (no tensor parallelism)."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**job.config_kwargs(variant)))
    for name, p in model.state_dict().items():
        p.set_value(paddle.to_tensor(job.weight_values(name, p.shape, step)))
    return paddle_logits(model, ids)


IDS = np.array([[0, 1, 2, 127, 5, 64, 99, 3, 126, 17, 0, 2],
                [1, 42, 7, 2, 0, 88, 113, 127, 9, 1, 63, 65]])  # pad 0, bos 1, eos 2, the last id

# topology: (ranks, job arguments, variants, transformers check)
TOPOLOGIES = {
    "mp2": (2, ["--mp", "2", "--checks"], ["fused", "unfused"], True),
    "mp4": (4, ["--mp", "4"], ["fused", "unfused"], True),
    "dp2xmp2": (4, ["--dp", "2", "--mp", "2"], ["fused"], False),
    # LlamaForCausalLMPipe: the package names its tensors as the single model does and maps the whole
    # model with the llama_paddlenlp preset (each stage holds only its own layers)
    "pp2xmp2": (4, ["--pp", "2", "--mp", "2"], ["unfused", "fused"], True),
}


@pytest.fixture(scope="module")
def references():
    """{variant: (single-process shapes, {step: expected HF tensors}, step-2 logits)}, computed once."""
    out = {}
    for variant in ("fused", "unfused"):
        shapes = job.single_shapes(variant)
        out[variant] = (shapes, {s: expected_hf(variant, s, shapes) for s in (1, 2)},
                        single_process_logits(variant, 2, IDS))
    return out


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_tensor_parallel_paddlenlp_llama_exports_the_single_process_model(tmp_path, topology, references, hf_python):
    nproc, args, variants, hf_check = TOPOLOGIES[topology]
    res = harness.run_launch(ROOT / "tests" / "multirank" / "pnlp_tp_job.py",
                             [*args, "--variants", ",".join(variants), "--out", tmp_path], nproc=nproc,
                             log_dir=tmp_path / "log", timeout=300)
    assert res.rc == 0 and not res.timed_out, res.describe()
    reports = [r for _, r in res.tagged("PNLP_TP")]
    assert len(reports) == nproc * len(variants), res.describe()
    pp = 2 if "--pp" in args else 1
    mp = int(args[args.index("--mp") + 1])
    for r in reports:
        # Paddle's dict contradicts PaddleNLP's layout in the LM head only, and the fixed one nowhere
        holds_head = LM in r["params"]
        assert holds_head == (r["stage"] == pp - 1)
        assert {p.split(":")[0] for p in r["raw_problems"]} == ({LM} if holds_head else set()), r["raw_problems"]
        assert r["fixed_problems"] == [], r["fixed_problems"]
        assert len(r["fixes"]) == int(holds_head), r
        if holds_head:
            assert r["fixes"][0].startswith(
                f"parameter 'lm_head.weight': sharded_state_dict says global [64, {128 // mp}] at [0, 0] on every mp rank, "
                f"but the parameter is split over {mp} ranks along axis 1 (is_distributed=True; split_axis=1; "
                f"layer LlamaLMHead: axis 1; paddlenlp split action (is_column=True): axis 1): exported as global "
                f"[64, 128] at [0, {128 // mp * r['mp_rank']}]"), r["fixes"][0]
        kv_split = r["variant"].startswith("fused") or 2 % mp == 0  # 2 kv heads do not split over 4 ranks: replicated
        k_proj = [k for k in r["params"] if k.endswith("k_proj.weight")]
        assert all((k in r["distributed"]) == kv_split for k in k_proj)
        assert "setup_error" not in r, r["setup_error"]
        assert r["events"] == ["every_n_steps@1", "every_n_steps@2"] and r["errors"] == [], r
        assert r["warnings"] == r["fixes"], r  # the correction is logged, once per parameter and job
    writers = {r["rank"] for r in reports if any(r.get("files_written_here", ()))}
    assert len(writers) >= 2, reports  # the snapshot is written by several ranks at once

    for variant in variants:
        shapes, expected, logits = references[variant]
        for step in (1, 2):
            snap = tmp_path / variant / f"hf-step-{step:06d}"
            report = verify_snapshot(snap)
            assert report.ok, report.errors
            got = snapshot_tensors(snap)
            assert set(got) == set(expected[step]), sorted(set(got) ^ set(expected[step]))
            for k, v in expected[step].items():
                assert got[k].dtype == v.dtype and got[k].shape == v.shape, (k, got[k].shape, v.shape)
                assert got[k].tobytes() == v.tobytes(), f"{topology} {variant} step {step}: {k} differs"
        config = json.loads((snap / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 128
        assert not [k for k in config if re.search(r"parallel_(degree|rank|size)$", k)], sorted(config)
        if hf_check:
            hf = run_hf_client(hf_python, snap, IDS, logits, tmp_path / variant)
            assert hf["missing_keys"] == [] and hf["unexpected_keys"] == [] and hf["mismatched_keys"] == [], hf
            assert hf["max_abs_diff"] <= 1e-4, (topology, variant, hf)
            print(f"{topology} {variant}: transformers max |logit diff| {hf['max_abs_diff']:.2e} "
                  f"(|logits| up to {np.abs(logits).max():.2f}); launch {res.seconds:.1f} s")

    if "--checks" in args:
        checks = [c for _, c in res.tagged("PNLP_CHECKS")]
        assert len(checks) == nproc
        for c in checks:  # the symptom without the fix, on every rank: refused before the first byte
            # (by the mapping check: the head PaddleNLP's dict describes is not the model's; before that check
            # existed, the assembler found "ranks [0, 1] hold the same slice at [0, 0] with different values")
            assert "lm_head.weight is [64, 64], expected [128, 64]" in c["raw_export"], c
            assert c["contradiction"] == (
                "ShardLayoutError: parameter 'lm_head.weight': sharded_state_dict says global [64, 64] at [0, 0] on "
                "every mp rank, but the parameter is split over 2 ranks (is_distributed=True; split_axis=0; layer "
                "LlamaLMHead: axis 1; paddlenlp split action (is_column=True): axis 1): the marks disagree on the "
                "split axis, so its global shape cannot be known; refusing to export it"), c
