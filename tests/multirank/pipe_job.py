"""PaddleFormers ``*ForCausalLMPipe`` models on real pipeline ranks, exported by the real callback.

Launched, one launch per topology with every architecture inside it::

    python -m paddle.distributed.launch --nproc_per_node 2 pipe_job.py --pp 2 --out DIR/pp2
    python -m paddle.distributed.launch --nproc_per_node 4 pipe_job.py --pp 2 --mp 2 --out DIR/pp2xmp2

Each rank builds every case of ``CASES`` (the zoo's tiny config with 3 decoder layers, cut into
uneven stages with ``pp_seg_method``, see ``SPLITS``), writes "trained" weights into its shards and
exports through the trainer's callback handler (``FullParamExportCallback``: ``on_train_begin``,
``on_step_end`` at step 1 with ``every_n_steps=1``, ``on_train_end``) into ``DIR/snap/<case>/``.
It prints ``PIPE {json}`` per case and writes them to ``DIR/report-rank<N>.json``.

The weights. :func:`trained_values` gives every tensor of the *plain single-process* model
(``LlamaForCausalLM``...) deterministic values, by name. Each rank puts into its shards the block
the tensor-parallel layers compute with (:func:`shard_block`), read from PaddleFormers' layer code,
not from the name mapping: a column-parallel fused gate/up holds ``[gate_r | up_r]`` on mp rank
``r`` (``BaseMLP.forward`` chunks its local output in two), Phi3's fused q/k/v holds
``[q_r | k_r | v_r]`` (``Phi3Attention.forward`` splits its local output by its own head counts),
the grouped q/k/v of Ernie 4.5, Qwen2/3 and Gemma3 holds whole key/value groups (a contiguous
block), GPT-OSS's ``sinks`` holds the rank's heads. Everything else is the block the sharded state
dict names. So the Pipe on every topology computes the plain model's function, and its snapshot
must be the single-process snapshot of the plain model, bit for bit.

Then, single process (no launch), after the launches::

    python pipe_job.py --reference DIR --topologies pp2,pp2xmp2

For each case: the plain class with the same values, exported single-process (``ExportSession``
+ ``build_model_source``) into ``DIR/ref/<case>/``; Paddle's logits of the plain class, and of the
function the Pipe computes (see the padding index below); every Pipe snapshot reloaded by
PaddleFormers' single-process ``from_pretrained`` of the plain class (weights and logits). Writes
``DIR/reference.json`` and ``DIR/hf_entries.json`` (for ``tests/zoo/hf_check.py``).

Padding index. PaddleFormers' pipeline embedding (``EmbeddingPipe`` -> ``Embedding.create(config)``)
passes no ``padding_idx`` (and under tensor parallelism it is a ``VocabParallelEmbedding``, which has
none), where the plain Llama passes ``pad_token_id``: the trained Pipe returns the stored row for
that id, and so must the snapshot. Gemma3's pipeline embedding is its own
``Gemma3TextScaledWordEmbedding`` with ``padding_idx`` on every topology, like the plain class.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "zoo"), str(HERE.parent)]

import numpy as np  # noqa: E402

import harness  # noqa: E402

LAYERS = 3
# uneven stages. pp_seg_method: the index of each stage's first item in
# [embedding, layer 0, layer 1, layer 2, norm, lm_head]
SPLITS = {
    "pp2": [0, 3],  # stage 0: embedding, layers 0-1; stage 1: layer 2, norm, lm_head
    "pp2xmp2": [0, 2],  # stage 0: embedding, layer 0; stage 1: layers 1-2, norm, lm_head
}
STAGE_LAYERS = {"pp2": [[0, 1], [2]], "pp2xmp2": [[0], [1, 2]]}
TOPOLOGIES = {"pp2": dict(pp=2, mp=1, nproc=2), "pp2xmp2": dict(pp=2, mp=2, nproc=4)}
STEP = 1
EXPORT = ["export.max_shard_size=64KB", "retention.keep_last=0", "on_error=raise"]
# FP8 (export.quantization) of these cases too, by a second callback in the same launch, and single-process in the
# reference: bfloat16 (on pp2 x mp2 the holders cast before the bytes travel), blocks that leave partial edges
FP8_CASES = ("llama",)
FP8 = ["export.quantization=fp8", "export.quantization_block=[16,48]", "export.dtype=bfloat16"]

GPT_OSS_SINKS = ("PaddleFormers 1.2's GptOssAttention.sinks holds the rank's num_heads / tp heads under tensor "
                 "parallelism but is a plain parameter (no is_distributed / split_axis): its sharded state dict says "
                 "the mp ranks hold replicas of a [num_heads / tp] tensor, which they do not")


@dataclass(frozen=True)
class PipeCase:
    id: str
    zoo: str  # the zoo case (tests/zoo/cases_pf.py): tiny config, plain class, HF class, import stand-ins
    pipe_class: str
    config: dict = field(default_factory=dict)  # changes to the zoo config (besides the layer count)
    qkv: str = "grouped"  # layout of a fused q/k/v: "grouped" (per key/value group) | "q|k|v"
    forward: bool = True  # Paddle's forward of the plain class runs on CPU
    mode: str = "eval"
    build_error: str = ""  # a regex: building the Pipe fails here (recorded, nothing exported)
    export_error: dict = field(default_factory=dict)  # topology -> regex: the export is refused
    reload: str = ""  # why PaddleFormers' from_pretrained does not give back the snapshot ("" = it does)


CASES = [
    PipeCase("llama", "pf-llama-untied", "LlamaForCausalLMPipe"),
    PipeCase("llama-tied", "pf-llama-tied", "LlamaForCausalLMPipe"),
    PipeCase("ernie4_5", "pf-ernie4_5-untied", "Ernie4_5ForCausalLMPipe"),
    PipeCase("phi3", "pf-phi3-untied", "Phi3ForCausalLMPipe", qkv="q|k|v"),
    PipeCase("gemma3", "pf-gemma3-untied", "Gemma3ForCausalLMPipe",
             reload="PaddleFormers 1.2's Gemma3 loader fills lm_head.weight from model.embed_tokens.weight "
                    "although the model is untied"),
    # the zoo's GPT-OSS says tie_word_embeddings=True, which the plain class ignores (it keeps its
    # head) but the Pipe obeys (a shared embedding/head): untied, both are the same model
    PipeCase("gpt_oss", "pf-gpt_oss", "GptOssForCausalLMPipe", {"tie_word_embeddings": False}, mode="train",
             export_error={"pp2xmp2": r"'model\.layers\.0\.self_attn\.sinks': ranks \[0, 1\] hold the same slice at \[0\] "
                                      r"with different values \(replicas out of sync\)"}),
    PipeCase("qwen2", "pf-qwen2-untied", "Qwen2ForCausalLMPipeDeprecated"),
    PipeCase("qwen3", "pf-qwen3", "Qwen3ForCausalLMPipeDeprecated"),
    # Ernie4_5_MoeConfig's default moe_group "mp" needs sequence_parallel (below); "dummy" builds.
    # Its MoE forward needs GPU kernels: names, shapes and bytes are compared
    PipeCase("ernie4_5_moe", "pf-ernie4_5_moe", "Ernie4_5_MoeForCausalLMPipe", {"moe_group": "dummy"}, forward=False,
             reload="PaddleFormers 1.2's Ernie4_5_Moe loader asks for mtp_block tensors of a model without MTP layers"),
    PipeCase("ernie4_5_moe-default", "pf-ernie4_5_moe", "Ernie4_5_MoeForCausalLMPipe",
             build_error=r"^AssertionError: .*pp_model\.py:\d+ assert config\.sequence_parallel$"),
]


def zoo_case(case: PipeCase):
    from cases_pf import CASES as ZOO

    return {c.id: c for c in ZOO}[case.zoo]


def plain_kwargs(case: PipeCase) -> dict:
    """The plain class's tiny config: the zoo's, with LAYERS decoder layers."""
    return dict(zoo_case(case).config, num_hidden_layers=LAYERS, **case.config)


def pipe_kwargs(case: PipeCase, topology: str) -> dict:
    return dict(plain_kwargs(case), pp_seg_method=list(SPLITS[topology]))


def trained_values(name: str, shape) -> np.ndarray:
    """Deterministic float32 values of the plain model's tensor ``name`` (a trained model's: every
    element distinct, norms near 1), the same on every rank and in the single-process reference."""
    shape = tuple(int(d) for d in shape)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    v = (rng.standard_normal(shape) * 0.08).astype(np.float32)
    if len(shape) == 1 and re.search(r"norm\.weight$", name):
        v = (v + np.float32(1.0)).astype(np.float32)
    return v


def value_name(key: str, tied: bool) -> str:
    """A tied model's head is its embedding: both copies (first and last stage) hold the same values."""
    return "model.embed_tokens.weight" if tied and key == "lm_head.weight" else key


def shard_block(case: PipeCase, config, key: str, sw, mp: int, r: int):
    """(full plain tensor's shape, this rank's block of it as the layers compute with it); see the
    module docstring for the tensor-parallel layouts."""
    local, gshape = tuple(int(d) for d in sw.local_shape), tuple(int(d) for d in sw.global_shape)
    if mp > 1 and key.endswith("self_attn.sinks"):
        heads = int(config.num_attention_heads)
        assert local == gshape == (heads // mp,), (key, local, gshape)  # what PaddleFormers reports
        return (heads,), lambda full: full[r * local[0]:(r + 1) * local[0]]
    if mp > 1 and local != gshape and (key.endswith(("up_gate_proj.weight", "gate_up_proj.weight"))
                                       or (case.qkv == "q|k|v" and key.endswith("qkv_proj.weight"))):
        if key.endswith("qkv_proj.weight"):
            d = int(config.hidden_size // config.num_attention_heads if not getattr(config, "head_dim", None)
                    else config.head_dim)
            widths = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
        else:
            widths = [gshape[1] // 2, gshape[1] // 2]  # [gate | up]

        def block(full):
            parts, start = [], 0
            for w in widths:
                n = w // mp
                parts.append(full[:, start + r * n:start + (r + 1) * n])
                start += w
            out = np.concatenate(parts, axis=1)
            assert out.shape == local, (key, out.shape, local)
            return out

        return gshape, block
    index = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(sw.global_offset, sw.local_shape))
    return gshape, lambda full: full[index]


# ----------------------------------------------------------------------------------------------
# launched ranks
# ----------------------------------------------------------------------------------------------


def set_trained_values(case: PipeCase, model, mp: int, r: int) -> bool:
    """Write every shard's block; True when reading the parameters back gives exactly those bytes."""
    import paddle

    tied = bool(model.config.tie_word_embeddings)
    ok = True
    for key, sw in model.sharded_state_dict().items():
        shape, block = shard_block(case, model.config, key, sw, mp, r)
        want = np.ascontiguousarray(block(trained_values(value_name(key, tied), shape)))
        t = sw.local_tensor
        t.set_value(paddle.to_tensor(want).astype(t.dtype))
        ok = ok and np.asarray(t.numpy()).tobytes() == want.tobytes()
    return ok


def embedding_layer(model):
    """(class name, padding_idx) of this rank's input embedding, if its stage has it."""
    from paddle_fullparam_callbacks.models.pipe import input_embedding

    emb = input_embedding(model)
    return (type(emb).__name__, getattr(emb, "_padding_idx", None)) if emb is not None else (None, None)


def described_config(model) -> dict:
    """What the package writes into config.json for ``model`` (its tie as the package decides it)."""
    from paddle_fullparam_callbacks.models.model_info import hf_config_dict, output_embedding

    return hf_config_dict(model, output_embedding(model, model.sharded_state_dict())[1])


def build_pipe(case: PipeCase, topology: str):
    import importlib

    import paddle

    from run_zoo import install_shims

    zc = zoo_case(case)
    install_shims(zc.shims)
    mod = importlib.import_module(zc.module)
    config = getattr(mod, zc.config_class)(**pipe_kwargs(case, topology))
    paddle.seed(0)
    # tied models create a group for the shared embedding/head: gloo's group creation race
    # (harness.gloo_safe_group_creation) applies to it too
    with harness.gloo_safe_group_creation():
        return getattr(mod, case.pipe_class)(config)


def where(e: BaseException) -> str:
    import traceback

    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {e} at {Path(frame.filename).name}:{frame.lineno} {frame.line}"


def run_case(case: PipeCase, topology: str, out: Path, hcg, budget=None) -> dict:
    import types

    import paddle.distributed as dist
    from paddleformers.trainer.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    from paddle_fullparam_callbacks import FullParamExportCallback

    mp, r = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    rep = {"rank": dist.get_rank(), "case": case.id, "stage": hcg.get_stage_id(), "mp_rank": r}
    t0 = time.perf_counter()
    try:
        model = build_pipe(case, topology)
    except Exception as e:  # deterministic, before any collective of the model: every rank gets here
        rep["build_error"] = where(e)
        return rep
    rep["values_set"] = set_trained_values(case, model, mp, r)
    rep["places"] = sorted({str(p.place) for p in model.parameters()})
    sd = model.sharded_state_dict()
    rep["layers"] = sorted({int(m.group(1)) for k in sd for m in [re.match(r"model\.layers\.(\d+)\.", k)] if m})
    rep["segment_parts"] = [int(p) for p in getattr(model, "segment_parts", [])]
    rep["tied"] = bool(model.config.tie_word_embeddings)
    rep["embedding"], rep["padding_idx"] = embedding_layer(model)
    rep["hf_config"] = described_config(model)
    on_device = [f"export.device_memory_budget={budget}"] if budget else []
    cb = FullParamExportCallback(None, overrides=[f"output_dir={out / 'snap' / case.id}", "trigger.every_n_steps=1",
                                                  *EXPORT, *on_device])
    callbacks = [cb]
    if case.id in FP8_CASES:  # within the same device budget (the launch's device_peak covers both exports)
        callbacks.append(FullParamExportCallback(None, overrides=[f"output_dir={out / 'fp8' / case.id}",
                                                                  "trigger.every_n_steps=1", *EXPORT, *FP8, *on_device]))
    handler = CallbackHandler(callbacks, model, None, None, None)
    args = types.SimpleNamespace(output_dir=str(out))
    state, control = TrainerState(), TrainerControl()
    try:
        handler.on_train_begin(args, state, control)
        state.global_step = STEP
        rep["device_peak"] = harness.device_peak(lambda: handler.on_step_end(args, state, control))[1]
        handler.on_train_end(args, state, control)
    except Exception as e:  # the package reports a failed plan or export on every rank alike
        rep["export_error"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    rep.update(
        events=list(cb.events), errors=list(cb.errors),
        snapshots=[str(s.path) for s in cb.snapshots if s.path is not None],
        files_written_here=[s.files_written_here for s in cb.snapshots],
        seconds=round(time.perf_counter() - t0, 2),
    )
    if len(callbacks) > 1:
        rep["fp8"] = {"errors": list(callbacks[1].errors),
                      "snapshots": [str(s.path) for s in callbacks[1].snapshots if s.path is not None]}
    return rep


def launched(ns) -> None:
    import paddle.distributed as dist

    # Paddle 3.3.1 defect: ParallelEnv.__init__ sets _device_id only on custom-device, CUDA and XPU
    # builds, so on a CPU build PipelineLayer.__init__ (pp_layers.py:453, `dist.ParallelEnv().device_id`)
    # fails with "AttributeError: 'ParallelEnv' object has no attribute '_device_id'". Nothing
    # uses the id on CPU: give the class the default the GPU path reads (FLAGS_selected_gpus "0").
    if not hasattr(dist.ParallelEnv(), "_device_id"):
        dist.ParallelEnv._device_id = 0
    topology = "pp2xmp2" if ns.mp > 1 else "pp2"
    hcg = harness.init_fleet(mp=ns.mp, pp=ns.pp, device=ns.device)
    from paddle_fullparam_callbacks.cli.demo import quiet_framework_logs

    quiet_framework_logs()
    out = Path(ns.out)
    reports = []
    for case in CASES:
        if ns.only and case.id not in ns.only.split(","):
            continue
        rep = run_case(case, topology, out, hcg, ns.budget)
        print("PIPE " + json.dumps(rep), flush=True)
        reports.append(rep)
    (out / f"report-rank{dist.get_rank()}.json").write_text(json.dumps(reports, indent=1))
    dist.barrier()
    # everything is written: leave without running the process groups' and stores' destructors,
    # whose teardown order across ranks is not this test's subject (a rank whose store server
    # went away first has been seen to abort in them, once in a dozen launches)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------
# single-process reference, after the launches
# ----------------------------------------------------------------------------------------------


def build_plain(case: PipeCase):
    import importlib

    import paddle

    from run_zoo import install_shims

    zc = zoo_case(case)
    install_shims(zc.shims)
    mod = importlib.import_module(zc.module)
    paddle.seed(0)
    config = getattr(mod, zc.config_class)(**plain_kwargs(case))
    return config, getattr(mod, zc.model_class)(config)


def weights_of(model) -> dict:
    return {k: harness.tensor_to_numpy_bits(v) for k, v in model.state_dict().items()}


def reference_case(case: PipeCase, root: Path, topologies, reports: dict) -> tuple:
    import paddle

    from _helpers import paddle_logits
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source
    from run_zoo import input_ids

    entry = {"case": case.id}
    config, model = build_plain(case)
    tied = bool(config.tie_word_embeddings)
    state = model.state_dict()
    values = {k: trained_values(value_name(k, tied), v.shape) for k, v in state.items()}
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in values.items()})
    entry["values_set"] = all(w.tobytes() == values[k].tobytes() for k, w in weights_of(model).items())
    entry["hf_config"] = described_config(model)
    cfg = load_config(None, [f"output_dir={root / 'ref' / case.id}", *EXPORT])
    session = ExportSession(cfg, cfg.output_dir)
    session.start()
    entry["snapshot"] = str(session.export(build_model_source(model, cfg), STEP, reason="reference").path)
    if case.id in FP8_CASES:
        cfg = load_config(None, [f"output_dir={root / 'ref-fp8' / case.id}", *EXPORT, *FP8])
        fp8 = ExportSession(cfg, cfg.output_dir)
        fp8.start()
        entry["fp8_snapshot"] = str(fp8.export(build_model_source(model, cfg), STEP, reason="reference").path)
    emb = model.get_input_embeddings()
    entry["plain_padding_idx"] = getattr(emb, "_padding_idx", None)
    pads = {r["padding_idx"] for t in topologies for r in reports[t].get(case.id, []) if r.get("embedding")}
    assert len(pads) <= 1, pads
    entry["pipe_padding_idx"] = pipe_pad = pads.pop() if pads else None
    ids_file, plain_file, trained_file = (root / "ref" / f"{case.id}-{x}.npy" for x in ("ids", "plain", "trained"))
    if case.forward:
        ids = input_ids(config)
        np.save(ids_file, ids)
        plain = paddle_logits(model, ids, case.mode)
        np.save(plain_file, plain)
        trained = plain
        if pipe_pad != entry["plain_padding_idx"]:
            # the function the trained Pipe computes: its embedding's padding index, not the plain class's
            saved, emb._padding_idx = emb._padding_idx, pipe_pad
            trained = paddle_logits(model, ids, case.mode)
            emb._padding_idx = saved
        np.save(trained_file, trained)
        entry["logits_absmax"] = float(np.max(np.abs(plain)))
        entry["plain_vs_trained_max_abs_diff"] = float(np.max(np.abs(plain - trained)))
    # the rows of the plain model's embedding (for the snapshot's padding row)
    entry["embedding_rows"] = {str(row): values["model.embed_tokens.weight"][row].tolist()
                               for row in {entry["plain_padding_idx"], pipe_pad} - {None}}
    hf_entries, entry["reload"] = [], {}
    for t in topologies:
        snaps = sorted({s for r in reports[t].get(case.id, []) for s in r.get("snapshots", [])})
        if not snaps:
            continue
        snap = Path(snaps[-1])
        hf_entries.append({"id": f"{t}/{case.id}", "snapshot": str(snap), "forward": case.forward,
                           "ids": str(ids_file) if case.forward else None,
                           "logits": str(trained_file) if case.forward else None})
        entry["reload"][t] = reload(case, snap, root / "reload" / t / case.id, values, ids_file, plain_file)
    if case.reload:  # a defect of the framework's loader: the single-process snapshot shows it too
        entry["reload_ref"] = reload(case, Path(entry["snapshot"]), root / "reload" / "ref" / case.id, values,
                                     ids_file, plain_file)
    return entry, hf_entries


def reload(case: PipeCase, snap: Path, copy: Path, values: dict, ids_file: Path, plain_file: Path) -> dict:
    """The snapshot loaded by PaddleFormers' single-process ``from_pretrained`` of the plain class:
    which weights differ from the plain model's (padding rows the snapshot zeroed, as its manifest
    says, count as zeros), and its logits against the plain model's."""
    import shutil

    from _helpers import paddle_logits

    zc = zoo_case(case)
    zeroed = json.loads((snap / "fullparam_manifest.json").read_text()).get("model", {}).get("padding_rows_zeroed", {})
    expected = dict(values)
    for name, row in zeroed.items():
        expected[name] = expected[name].copy()
        expected[name][row] = 0
    out = {}
    shutil.copytree(snap, copy)  # PaddleFormers' loader may write next to the files it reads
    try:
        mod = __import__(zc.module, fromlist=[zc.model_class])
        reloaded = getattr(mod, zc.model_class).from_pretrained(str(copy), convert_from_hf=True, dtype="float32")
        got = weights_of(reloaded)
        out["weights_differ"] = sorted(k for k in got if k not in expected or got[k].tobytes() != expected[k].tobytes())
        out["weights_missing"] = sorted(set(expected) - set(got))
        if case.forward:
            logits = paddle_logits(reloaded, np.load(ids_file), case.mode)
            out["max_abs_diff_vs_plain"] = float(np.max(np.abs(logits - np.load(plain_file))))
    except Exception as e:  # reported; the test decides
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def reference(ns) -> None:
    import traceback

    from paddle_fullparam_callbacks.cli.demo import quiet_framework_logs

    quiet_framework_logs()
    root = Path(ns.reference)
    topologies = ns.topologies.split(",")
    reports = {}
    for t in topologies:
        by_case = {}
        for f in sorted((root / t).glob("report-rank*.json")):
            for r in json.loads(f.read_text()):
                by_case.setdefault(r["case"], []).append(r)
        reports[t] = by_case
    (root / "ref").mkdir(parents=True, exist_ok=True)
    results, hf_entries = {}, []
    for case in CASES:
        if case.build_error or (ns.only and case.id not in ns.only.split(",")):
            continue
        t0 = time.perf_counter()
        try:
            entry, hf = reference_case(case, root, topologies, reports)
        except Exception as e:
            entry, hf = {"case": case.id, "fatal": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}, []
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        results[case.id] = entry
        hf_entries += hf
        print(json.dumps({k: entry.get(k) for k in ("case", "seconds", "fatal")}), flush=True)
    (root / "reference.json").write_text(json.dumps(results, indent=1))
    (root / "hf_entries.json").write_text(json.dumps(hf_entries, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--only", default="", help="comma-separated case ids")
    ap.add_argument("--reference", help="the directory holding one sub-directory per topology")
    ap.add_argument("--topologies", default="pp2,pp2xmp2")
    ap.add_argument("--device", default="cpu", help="where the parameters live (fakedev: the fake accelerator)")
    ap.add_argument("--budget", default=None, help="export.device_memory_budget")
    ns = ap.parse_args()
    if ns.reference:
        reference(ns)
    else:
        launched(ns)


if __name__ == "__main__":
    main()
