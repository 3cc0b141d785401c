"""Golden results of every mapping preset: what each one does with the zoo's models and variants.

For every preset and a set of mapping contexts (the zoo's tiny models, recorded once, plus variants:
tie flipped, tensor-parallel degrees, optional tensors removed or added, configs each preset
translates or refuses), the *result* of the preset is recorded:

- the destination map its statements give through AOAEngine (``build_destination_map``): per
  destination, a hash of its shape, dtype and source slices (target box, source key and box,
  postprocessing: transposes, casts). Temporary names and statement order are not in it, so a
  rewritten preset that moves every element to the same place has the same hashes;
- the config.json keys its ``hf_config`` writes (in their order), and the warnings it logs;
- or the error it raises (type and message, exactly).

    python tests/unit/preset_golden.py sources   # in the PaddleNLP env, then in the PaddleFormers env
    python tests/unit/preset_golden.py golden    # any Paddle env: data/preset_golden.json

``sources`` builds the zoo's models (needs the framework) and records their tensors' names, shapes
and dtypes and their configs into ``data/preset_sources.json``; ``golden`` needs Paddle only.
``test_preset_golden.py`` recomputes everything and compares.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "data" / "preset_sources.json"
GOLDEN = HERE / "data" / "preset_golden.json"
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests"))


# ---- recording the zoo's sources (framework environments) ----------------------------------

def record_sources(framework: str) -> None:
    """Add the preset cases of ``framework``'s zoo to ``data/preset_sources.json``."""
    sys.path[:0] = [str(ROOT / "tests" / "zoo"), str(ROOT / "tests"), str(ROOT)]
    from case import all_cases  # noqa: E402
    from run_zoo import build  # noqa: E402  (tests/zoo)

    from paddle_fullparam_callbacks.assemble.mapping import dtype_name
    from paddle_fullparam_callbacks.models.mappings.resolve import auto_preset
    from paddle_fullparam_callbacks.models.model_info import output_embedding, parallel_degrees, single_process_config

    data = json.loads(SOURCES.read_text()) if SOURCES.exists() else {}
    for case in all_cases(framework):
        if case.refused:
            continue
        config, model = build(case)
        preset = auto_preset(model)
        if preset is None:
            continue
        sd = model.sharded_state_dict()
        data[case.id] = {
            "preset": preset.name,
            "tied": bool(output_embedding(model, sd)[1]),
            "parallel": parallel_degrees(config),
            "config": single_process_config(config),
            "sources": {k: [list(sw.global_shape), dtype_name(sw.local_tensor)] for k, sw in sorted(sd.items())},
        }
        print(case.id, preset.name, len(sd), "tensors")
    SOURCES.parent.mkdir(exist_ok=True)
    SOURCES.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# ---- variants ---------------------------------------------------------------------------------

class Variant:
    """One preset applied to one context: a recorded zoo case, changed by ``edit``."""

    def __init__(self, vid: str, base: str, edit: Optional[Callable[[dict], None]] = None, preset: Optional[str] = None):
        self.id, self.base, self.edit, self.preset = vid, base, edit, preset

    def case(self, sources: dict) -> dict:
        case = copy.deepcopy(sources[self.base])
        if self.edit is not None:
            self.edit(case)
        if self.preset:
            case["preset"] = self.preset
        return case


def _cfg(**kw):
    return lambda c: c["config"].update(kw)


def _drop(*suffixes):
    """Remove the source tensors whose names end with one of ``suffixes``."""
    def edit(c):
        c["sources"] = {k: v for k, v in c["sources"].items() if not k.endswith(suffixes)}
    return edit


def _add(**tensors):
    """Add source tensors, ``name=(shape, dtype)`` (name with ``__`` for ``.``)."""
    def edit(c):
        for k, v in tensors.items():
            c["sources"][k.replace("__", ".")] = [list(v[0]), v[1]]
    return edit


def _drop_linear_biases(c):
    c["sources"] = {k: v for k, v in c["sources"].items() if not (k.endswith(".bias") and "norm" not in k)}


def _set(**fields):
    return lambda c: c.update(fields)


def _all(*edits):
    def edit(c):
        for e in edits:
            e(c)
    return edit


def _per_layer(c, prefix, fn):
    """Apply fn(case, layer prefix) for every ``{prefix}{N}.`` layer."""
    layers = sorted({k[len(prefix):].split(".")[0] for k in c["sources"] if k.startswith(prefix)})
    for n in layers:
        fn(c, f"{prefix}{n}")


def _gemma3_biases(c):
    def add(c, p):
        q = c["sources"][f"{p}.self_attn.qkv_proj.weight"][0][-1]
        o = c["sources"][f"{p}.self_attn.o_proj.weight"][0][-1]
        c["sources"][f"{p}.self_attn.qkv_proj.bias"] = [[q], "float32"]
        c["sources"][f"{p}.self_attn.o_proj.bias"] = [[o], "float32"]
    _per_layer(c, "model.layers.", add)


def _tp_split(*suffixes, n=2):
    """Sources ending with ``suffixes`` held as n column-parallel slices ([in, out]: along axis 1)."""
    def edit(c):
        c["split"] = {k: (1, n) for k in c["sources"] if k.endswith(suffixes)}
    return edit


def _llama_mixed(c):
    """Layer 0 fused (q/k/v and gate/up), layer 1 as separate tensors: decided per layer."""
    s = c["sources"]
    hidden = s["llama.embed_tokens.weight"][0][1]
    for k in [k for k in s if k.startswith("llama.layers.1.") and ("qkv_proj" in k or "gate_up_fused_proj" in k)]:
        del s[k]
    heads, kv = c["config"]["num_attention_heads"], c["config"]["num_key_value_heads"]
    hd = hidden // heads
    inter = c["config"]["intermediate_size"]
    s["llama.layers.1.self_attn.q_proj.weight"] = [[hidden, heads * hd], "float32"]
    s["llama.layers.1.self_attn.k_proj.weight"] = [[hidden, kv * hd], "float32"]
    s["llama.layers.1.self_attn.v_proj.weight"] = [[hidden, kv * hd], "float32"]
    s["llama.layers.1.mlp.gate_proj.weight"] = [[hidden, inter], "float32"]
    s["llama.layers.1.mlp.up_proj.weight"] = [[hidden, inter], "float32"]


VARIANTS = [
    # Llama (every zoo case is a variant of its own; see variants())
    Variant("pnlp-llama-bothfused-gqa/tp2", "pnlp-llama-bothfused-gqa", _set(parallel={"tensor_parallel_degree": 2})),
    Variant("pnlp-llama-bothfused-gqa/tp4", "pnlp-llama-bothfused-gqa", _set(parallel={"tensor_parallel_degree": 4})),
    Variant("pnlp-llama-bothfused-mqa/tp2", "pnlp-llama-bothfused-mqa", _set(parallel={"tensor_parallel_degree": 2})),
    Variant("pnlp-llama-qkvfused-mha/tp2", "pnlp-llama-qkvfused-mha", _set(parallel={"tensor_parallel_degree": 2})),
    Variant("pnlp-llama-bothfused-gqa/mixed-layers", "pnlp-llama-bothfused-gqa", _llama_mixed),
    Variant("pnlp-llama-unfused-gqa/tied", "pnlp-llama-unfused-gqa", _set(tied=True)),
    Variant("pnlp-llama-unfused-gqa/no-head", "pnlp-llama-unfused-gqa", _drop("lm_head.weight")),
    Variant("pnlp-llama-unfused-gqa/rope-ntk", "pnlp-llama-unfused-gqa", _cfg(rope_scaling_type="ntk", rope_scaling_factor=2.0)),
    Variant("pnlp-llama-unfused-gqa/rope-dynamic", "pnlp-llama-unfused-gqa",
            _cfg(rope_scaling_type="dynamic_ntk", rope_scaling_factor=4.0)),
    Variant("pnlp-llama-unfused-gqa/hf-keys", "pnlp-llama-unfused-gqa",
            _cfg(hidden_act="gelu", head_dim=99, attention_bias=True, rope_scaling={"rope_type": "yarn"},
                 sliding_window=4096, pretraining_tp=1, mlp_bias=False)),
    Variant("pnlp-llama-unfused-gqa/alibi", "pnlp-llama-unfused-gqa", _cfg(alibi=True)),
    Variant("pnlp-llama-unfused-gqa/long-seq", "pnlp-llama-unfused-gqa",
            _cfg(use_long_sequence_strategies=True, long_sequence_strategy_type="embedding_strategies",
                 long_sequence_strategy_name="YaRNScalingRotaryEmbedding")),
    Variant("pnlp-llama-unfused-gqa/rope-unknown", "pnlp-llama-unfused-gqa", _cfg(rope_scaling_type="yarn")),
    Variant("pnlp-llama-unfused-gqa/rope-factor", "pnlp-llama-unfused-gqa", _cfg(rope_scaling_type="linear", rope_scaling_factor=0)),
    Variant("pnlp-llama-qkvfused-mha/wrong-heads", "pnlp-llama-qkvfused-mha", _cfg(num_attention_heads=8)),
    Variant("pnlp-llama-qkvfused-mha/heads-kv", "pnlp-llama-qkvfused-mha", _cfg(num_key_value_heads=3)),
    Variant("pnlp-llama-qkvfused-mha/no-heads", "pnlp-llama-qkvfused-mha", _cfg(num_attention_heads=None)),
    Variant("pnlp-llama-ffnfused-gqa/tp-width", "pnlp-llama-ffnfused-gqa", _set(parallel={"tensor_parallel_degree": 5})),
    # Mixtral
    Variant("pnlp-mixtral/tied", "pnlp-mixtral", _set(tied=True)),
    Variant("pnlp-mixtral/hf-keys", "pnlp-mixtral", _cfg(sliding_window=4096, hidden_act="gelu", rope_theta=500.0)),
    # ChatGLMv2
    Variant("pnlp-chatglm2-glm/no-bias", "pnlp-chatglm2-glm", _all(_drop("query_key_value.bias"), _cfg(add_qkv_bias=False))),
    Variant("pnlp-chatglm2-glm/no-inv-freq", "pnlp-chatglm2-glm", _drop("rotary_pos_emb.inv_freq")),
    Variant("pnlp-chatglm2-glm/rope-ratio", "pnlp-chatglm2-glm", _cfg(rope_ratio=500)),
    Variant("pnlp-chatglm2-glm/tied", "pnlp-chatglm2-glm", _set(tied=True)),
    Variant("pnlp-chatglm2-glm/layernorm", "pnlp-chatglm2-glm", _cfg(rmsnorm=False)),
    Variant("pnlp-chatglm2-glm/post-ln", "pnlp-chatglm2-glm", _cfg(apply_residual_connection_post_layernorm=True)),
    Variant("pnlp-chatglm2-glm/no-final-norm", "pnlp-chatglm2-glm", _cfg(post_layer_norm=False)),
    Variant("pnlp-chatglm2-glm/bias-linear", "pnlp-chatglm2-glm", _cfg(add_bias_linear=True)),
    Variant("pnlp-chatglm2-glm/long-seq", "pnlp-chatglm2-glm", _cfg(use_long_sequence_strategies=True)),
    Variant("pnlp-chatglm2-glm/groups", "pnlp-chatglm2-glm", _cfg(multi_query_group_num=3)),
    Variant("pnlp-chatglm2-glm/width", "pnlp-chatglm2-glm", _cfg(kv_channels=8)),
    # Qwen-1
    Variant("pnlp-qwen1-qwen2/no-bias", "pnlp-qwen1-qwen2", _drop("c_attn.bias")),
    Variant("pnlp-qwen1-qwen2/tied", "pnlp-qwen1-qwen2", _set(tied=True)),
    Variant("pnlp-qwen1-qwen2/no-ntk", "pnlp-qwen1-qwen2", _cfg(use_dynamic_ntk=False, use_logn_attn=False)),
    Variant("pnlp-qwen1-qwen2/rotary-pct", "pnlp-qwen1-qwen2", _cfg(rotary_pct=0.5)),
    Variant("pnlp-qwen1-qwen2/bias", "pnlp-qwen1-qwen2", _cfg(no_bias=False)),
    Variant("pnlp-qwen1-qwen2/long-seq", "pnlp-qwen1-qwen2", _cfg(use_long_sequence_strategies=True)),
    Variant("pnlp-qwen1-qwen2/kv-channels", "pnlp-qwen1-qwen2", _cfg(kv_channels=8)),
    # GPT
    Variant("pnlp-gpt-tied/untied", "pnlp-gpt-tied", _set(tied=False)),
    Variant("pnlp-gpt-tied/no-biases", "pnlp-gpt-tied", _drop_linear_biases),
    Variant("pnlp-gpt-fusedqkv-tied/no-biases", "pnlp-gpt-fusedqkv-tied", _drop_linear_biases),
    Variant("pnlp-gpt-tied/post-ln", "pnlp-gpt-tied", _cfg(normalize_before=False, scale_qk_coeff=2.0, hidden_activation="relu")),
    Variant("pnlp-gpt-tied/ids", "pnlp-gpt-tied", _cfg(bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    # Bloom / RW
    Variant("pnlp-bloom-tied/untied", "pnlp-bloom-tied", _set(tied=False)),
    Variant("pnlp-bloom-tied/long-seq", "pnlp-bloom-tied", _cfg(use_long_sequence_strategies=True)),
    Variant("pnlp-rw-untied/tied", "pnlp-rw-untied", _set(tied=True)),
    Variant("pnlp-rw-untied/new-arch", "pnlp-rw-untied", _cfg(new_decoder_architecture=True)),
    # OPT / CTRL
    Variant("pnlp-opt-untied/no-final-norm", "pnlp-opt-untied", _drop("decoder.final_layer_norm.weight", "decoder.final_layer_norm.bias")),
    Variant("pnlp-opt-untied/tied", "pnlp-opt-untied", _set(tied=True)),
    Variant("pnlp-opt-untied/proj", "pnlp-opt-untied", _cfg(word_embed_proj_dim=16, hidden_act="gelu_pytorch")),
    Variant("pnlp-opt-untied/gelu", "pnlp-opt-untied", _cfg(hidden_act="gelu")),
    Variant("pnlp-ctrl-untied/head-bias", "pnlp-ctrl-untied", _add(lm_head__bias=((512,), "float32"))),
    Variant("pnlp-ctrl-untied/no-head-bias", "pnlp-ctrl-untied", _drop("lm_head.bias")),
    # GPT-J / CodeGen
    Variant("pnlp-gptj-untied/tied", "pnlp-gptj-untied", _set(tied=True)),
    Variant("pnlp-gptj-untied/no-buffers", "pnlp-gptj-untied", _drop("attn.bias", "attn.masked_bias")),
    Variant("pnlp-gptj-untied/no-head-bias", "pnlp-gptj-untied", _drop("lm_head.bias")),
    Variant("pnlp-gptj-untied/act", "pnlp-gptj-untied", _cfg(activation_function="gelu_pytorch_tanh")),
    Variant("pnlp-codegen-untied/buffers", "pnlp-codegen-untied", _add(transformer__h__1__attn__causal_mask=((1, 1, 64, 64), "float32"))),
    Variant("pnlp-codegen-untied/act", "pnlp-codegen-untied", _cfg(activation_function="elu")),
    # Gemma3
    Variant("pf-gemma3-untied/biases", "pf-gemma3-untied", _gemma3_biases),
    # Paddle's fused_qkv / fused_ffn macros split by the number of source slices
    Variant("pf-gemma3-untied/2-slices", "pf-gemma3-untied", _tp_split("qkv_proj.weight", "up_gate_proj.weight")),
    Variant("pf-gemma3-untied/4-slices", "pf-gemma3-untied", _tp_split("up_gate_proj.weight", n=4)),
    Variant("pnlp-llama-bothfused-gqa/tp2-slices", "pnlp-llama-bothfused-gqa",
            _all(_set(parallel={"tensor_parallel_degree": 2}), _tp_split("qkv_proj.weight", "gate_up_fused_proj.weight"))),
    Variant("pf-gemma3-tied/rope", "pf-gemma3-tied", _cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                                          rope_scaling={"x": 1}, paddleformers_version="1.2")),
]


def variants(sources: dict) -> Iterator[Tuple[str, dict]]:
    """(variant id, case) for every recorded zoo case and every variant of one."""
    for cid in sorted(sources):
        yield cid, copy.deepcopy(sources[cid])
    for v in VARIANTS:
        if v.base in sources:
            yield v.id, v.case(sources)


# ---- observing a preset -----------------------------------------------------------------------

def _hf_input(config: dict) -> dict:
    """What ``model_info.hf_config_dict`` hands a preset's ``hf_config``."""
    out = copy.deepcopy(config)
    q = out.get("quantization_config")
    if not (isinstance(q, dict) and q.get("quant_method")):
        out.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):
        out.pop(key, None)
    return out


def _destination_hashes(dmap) -> Dict[str, str]:
    """Per destination: a hash of its shape, dtype and source slices (as ``run_zoo.mapping_digest``)."""
    from _digest import destination_slices  # tests/

    return {name: hashlib.sha256(repr(destination_slices(dmap, name)).encode()).hexdigest()[:16]
            for name in sorted(dmap.entries)}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _capture(fn):
    """(result, warnings logged, error as 'Type: message' or None)."""
    log = logging.getLogger("paddle_fullparam_callbacks")
    handler = _Records()
    log.addHandler(handler)
    try:
        return fn(), handler.messages, None
    except Exception as e:  # the refusals are part of the result
        return None, handler.messages, f"{type(e).__name__}: {e}"
    finally:
        log.removeHandler(handler)


def _shards(key, shape, dtype, split):
    """The shard descriptions of one source: whole, or ``split=(axis, n)`` as n tensor-parallel slices."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    if not split:
        return [ShardedWeightDesc(key, shape, shape, (0,) * len(shape), dtype)]
    axis, n = split
    local = tuple(d // n if i == axis else d for i, d in enumerate(shape))
    return [ShardedWeightDesc(key, local, shape, tuple(r * local[axis] if i == axis else 0 for i in range(len(shape))), dtype)
            for r in range(n)]


def observe(case: dict) -> dict:
    """What the case's preset does with it: destinations (or error), config.json keys (or error), warnings."""
    from paddle_fullparam_callbacks.assemble.mapping import build_destination_map
    from paddle_fullparam_callbacks.models.mappings import PRESETS, MappingContext, check_destination_names

    preset = PRESETS[case["preset"]]
    shapes = {k: tuple(v[0]) for k, v in case["sources"].items()}
    ctx = MappingContext(dict(case["config"]), bool(case["tied"]), shapes, dict(case["parallel"]))
    info = {k: _shards(k, tuple(s), dt, case.get("split", {}).get(k)) for k, (s, dt) in case["sources"].items()}

    def mapping():
        dmap = build_destination_map(info, {"aoa_statements": preset.statements(ctx)})
        check_destination_names(dmap.names, preset.destination_pattern, preset.name)
        return _destination_hashes(dmap)

    out = {"preset": preset.name}
    dests, warned, err = _capture(mapping)
    out["destinations"] = dests if err is None else {"error": err}
    out["mapping_warnings"] = warned
    if preset.hf_config is not None:
        cfg, warned, err = _capture(lambda: preset.hf_config(_hf_input(case["config"])))
        # through JSON as config.json is written (tuples become lists), in its order (config.json's keys are not sorted)
        out["hf_config"] = json.loads(json.dumps(list(cfg.items()))) if err is None else {"error": err}
        out["hf_config_warnings"] = warned
    return out


def registry() -> dict:
    """Every preset's declared fields (what callers read besides its two functions) and ``AUTO``."""
    from paddle_fullparam_callbacks.models.mappings import AUTO, PRESETS

    fields = ("name", "description", "framework", "classes", "hf_architecture", "hf_model_type",
              "destination_pattern", "lm_head")
    presets = {name: {f: getattr(p, f) for f in fields} | {"hf_config": p.hf_config is not None}
               for name, p in sorted(PRESETS.items())}
    return json.loads(json.dumps({"presets": presets, "auto": {f"{fw}.{cls}": n for (fw, cls), n in sorted(AUTO.items())}}))


def observe_all(sources: dict) -> Dict[str, dict]:
    out = {vid: observe(case) for vid, case in variants(sources)}
    out[REGISTRY] = registry()
    return out


REGISTRY = "__registry__"


def main(argv) -> int:
    if argv[:1] == ["sources"]:
        import importlib.util

        for fw in ("paddlenlp", "paddleformers"):
            if importlib.util.find_spec(fw) is not None:
                record_sources(fw)
        return 0
    if argv[:1] == ["golden"]:
        sys.path.insert(0, str(ROOT))
        got = observe_all(json.loads(SOURCES.read_text()))
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"{len(got)} results -> {GOLDEN}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
