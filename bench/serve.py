"""Serving (issue 39): from a commit to an engine serving the snapshot, against the engine's own reload of the
same files and against restarting the engine on them (what users do today); and the training stall with
serving on against off.

Run (about half an hour; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/serve.py                      # -> bench/results/serve.json
    $PY bench/serve.py --sizes tiny --reps 9

A real vLLM server (its CPU build, ``requirements/vllm.txt``; ``tests/_vllm.py`` starts it as docs/serving.md
says) serves each model size: ``tiny`` (2 layers, hidden 128, 1.7 MB: vLLM's CPU attention needs head_dim >= 32)
and ``0.7GB`` (the 673 MB float32 Llama of the other benchmarks). Three snapshots of each are exported first
(seeds 0, 1, 2; the engine starts on the first). Then, interleaved, ``--reps`` times:

- **bare**: the engine's own reload of a candidate (``POST /collective_rpc reload_weights``), timed around
  that one call;
- **ours**: the other candidate committed to the serving hook (``consumers/serve``: verification of the
  snapshot, the swap agent, pause, reload, weight version, resume, the record), timed from the commit to the
  engine serving it (the record's ``served_s``);

and ``--restarts`` times: the engine stopped and started on a candidate, timed from the stop to its first answer
on ``/health`` (the first start of the engine counts as one more). The stall: children (as bench/eval_stall.py)
export ``--exports`` snapshots of the model through ``ExportSession`` with ``--steps`` steps of fixed CPU work
between them, the serving hook attached as the callback attaches it (``on``) or not (``off``), interleaved; the
stall of an export is the training thread's time for it (the export and every drain until the next one).

Targets: commit-to-served <= 1.2x the bare reload + 0.2 s; the stall with serving on <= 1.05x off; served in
<= 0.05x a restart's time.

**A LoRA run, adapter mode beside weights mode** (issue 48). The engine is started with LoRA (``--enable-lora
--max-lora-rank 8``, as docs/serving.md starts it for ``serve.adapter``) for every measurement of a size. Two LoRA
snapshots of the engine's base (r=8, alpha=16, every projection; merged weights plus their PEFT adapter) are committed,
interleaved, ``--reps`` times to a weights-mode hook (the merged weights reloaded: verify, pause, reload, name, resume)
and to an adapter-mode hook (the adapter verified and loaded in place under ``latest``), each timed from the commit to
served (``served_s``), with the seconds each kept the engine paused (0 in adapter mode: it never pauses). The
stall children then export a LoRA model with serving off, in weights mode and in adapter mode (``lora-*``), beside the
plain model's off/on. And vLLM 0.32's ``load_inplace`` defect (``consumers/serve/engines/vllm.py``: an adapter loaded
in place is read from disk again at every step that serves it) is measured: 32 generated tokens on the base, on the
adapter loaded plainly, and on the same adapter loaded in place.

Targets (adapter mode): commit-to-served <= 0.1x weights mode's at 0.7GB; the engine never paused.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "serve.json"
SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, fuse_rms_norm=False, tie_word_embeddings=False),
    "0.7GB": {**C.LLAMA_KWARGS, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
              "num_hidden_layers": 8, "max_position_embeddings": 2048},
}


def build(size: str, seed: int):
    import paddle

    paddle.set_device("cpu")
    paddle.seed(seed)
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SIZES[size]))


def export_snapshots(size: str, out: Path, seeds) -> list:
    """One snapshot per seed (steps 0, 1, ...), with the demo tokenizer where the vocabulary is its own."""
    from paddle_fullparam_callbacks.cli.demo import demo_tokenizer
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}"])
    session = ExportSession(cfg, out)
    session.start()
    tok = demo_tokenizer() if SIZES[size]["vocab_size"] == 512 else None
    paths = [session.export(build_model_source(build(size, s), cfg, tok), i).path for i, s in enumerate(seeds)]
    session.close()
    return paths


LORA = dict(target_modules=[r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"], r=8, lora_alpha=16)
LORA_RANK = 8  # the engine's --max-lora-rank


def build_lora(size: str, lora_seed: int):
    """A LoRAModel on the engine's base (seed 0), lora_B nonzero (``lora_seed``): a step of a LoRA run."""
    import numpy as np
    import paddle
    from paddleformers.peft import LoRAConfig, LoRAModel

    lm = LoRAModel(build(size, 0), LoRAConfig(**LORA))
    rng = np.random.default_rng(lora_seed)
    with paddle.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("lora_B"):
                p.set_value(paddle.to_tensor((0.01 * rng.standard_normal(p.shape)).astype("float32")))
    return lm


def lora_snapshots(size: str, out: Path, seeds) -> list:
    """One merged snapshot with its PEFT adapter per LoRA seed (steps 1, 2, ...)."""
    from paddle_fullparam_callbacks.cli.demo import demo_tokenizer
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}", "export.peft_adapter=inside"])
    session = ExportSession(cfg, out)
    session.start()
    tok = demo_tokenizer() if SIZES[size]["vocab_size"] == 512 else None
    paths = [session.export(build_model_source(build_lora(size, s), cfg, tok), i + 1).path for i, s in enumerate(seeds)]
    session.close()
    return paths


def serve_cfg(url: str, extra=()):
    from paddle_fullparam_callbacks.config import load_config

    return load_config(None, [f"serve.url={url}", "serve.timeout_s=120", "serve.reload_timeout_s=600", *extra]).serve


def size_case(size: str, work: Path, ns) -> dict:
    """One size: the engine started on its first snapshot, the swaps, the stall runs, then the restarts."""
    from _vllm import VLLMServer

    from paddle_fullparam_callbacks.consumers.serve.engines import VLLMEngine
    from paddle_fullparam_callbacks.consumers.serve.hook import ServeHook
    from paddle_fullparam_callbacks.consumers.serve.probe import initial_states

    base, *cands = export_snapshots(size, work / "snaps", (0, 1, 2))
    nbytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    tokenizer = SIZES[size]["vocab_size"] == 512
    server = VLLMServer(base, work / "vllm-0.log", max_model_len=128, tokenizer=tokenizer,
                        lora_rank=LORA_RANK).wait_ready()
    restart_s = [server.started_s]
    try:
        cfg = serve_cfg(server.url)
        hook = ServeHook(cfg, initial_states(cfg, {server.url: VLLMEngine(server.url).probe()}, base.parent), "bench")
        client = VLLMEngine(server.url, timeout_s=120, reload_timeout_s=600).client
        # a first swap, not counted: the agent, started with the hook, imports the package meanwhile (in a job
        # that happens before the first step)
        t = time.perf_counter()
        hook.committed(base.name, base, 0)
        assert hook.wait_for(base.name, 1800) and hook.drain()[-1].record["status"] == "ok"
        first_s = time.perf_counter() - t
        bare, ours, phases = [], [], []
        for rep in range(ns.reps):
            quiet = C.wait_quiet(max_wait=20)
            path = cands[rep % 2]
            t = time.perf_counter()
            client.call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
                        timeout_s=700)
            bare.append(time.perf_counter() - t)
            snap = cands[(rep + 1) % 2]
            hook.committed(snap.name, snap, int(snap.name.rsplit("-", 1)[1]))
            assert hook.wait_for(snap.name, 1800), "the swap did not end"
            entry = hook.drain()[-1].entries[server.url]
            assert entry["status"] == "ok", entry
            ours.append(entry["served_s"])
            phases.append({k: entry.get(k) for k in ("verify_s", "pause_s", "reload_s", "version_s", "resume_s",
                                                      "served_s")} | {"others_busy_percent": quiet.get("busy_percent")})
            print(f"{size} rep {rep}: bare reload {bare[-1]:.3f} s, commit to served {ours[-1]:.3f} s "
                  f"({json.dumps(phases[-1])})", flush=True)
        hook.close(600)
        adapter = adapter_case(size, work, server, ns)
        stall = stall_runs(size, work, server.url, ns.stall_reps, ns.exports, ns.steps)
        for r in range(ns.restarts):
            t = time.perf_counter()
            server.kill()
            server = VLLMServer(cands[r % 2], work / f"vllm-{r + 1}.log", max_model_len=128,
                                tokenizer=tokenizer, lora_rank=LORA_RANK).wait_ready()
            restart_s.append(time.perf_counter() - t)
            print(f"{size} restart {r}: {restart_s[-1]:.1f} s", flush=True)
    finally:
        server.kill()
    b, o, rs = C.median(bare), C.median(ours), C.median(restart_s)
    swap = {"snapshot_bytes": nbytes, "first_swap_s": round(first_s, 4), "bare_reload_s": bare, "commit_to_served_s": ours, "restart_s": restart_s,
            "phases": phases, "bare_reload_s_median": round(b, 4), "commit_to_served_s_median": round(o, 4),
            "restart_s_median": round(rs, 2), "served_vs_bare_bound": round(o / (1.2 * b + 0.2), 4),
            "served_over_restart": round(o / rs, 5),
            "met": {"commit_to_served <= 1.2x bare + 0.2 s": o <= 1.2 * b + 0.2, "served <= 0.05x restart": o <= 0.05 * rs}}
    return {"swap": swap, "adapter": adapter, "stall": stall}


def _commit(hook, snap: Path, url: str) -> dict:
    hook.committed(snap.name, snap, int(snap.name.rsplit("-", 1)[1]))
    assert hook.wait_for(snap.name, 1800), "the swap did not end"
    entry = hook.drain()[-1].entries[url]
    assert entry["status"] == "ok", entry
    return entry


def adapter_case(size: str, work: Path, server, ns) -> dict:
    """A LoRA run's snapshots into the engine in weights mode and in adapter mode, interleaved (see the module)."""
    from paddle_fullparam_callbacks.consumers.serve.engines import VLLMEngine
    from paddle_fullparam_callbacks.consumers.serve.hook import ServeHook
    from paddle_fullparam_callbacks.consumers.serve.probe import initial_states

    url = server.url
    cands = lora_snapshots(size, work / "lora", (11, 12))
    nbytes = {"weights": sum(f.stat().st_size for f in cands[0].glob("*.safetensors")),
              "adapter": sum(f.stat().st_size for f in (cands[0] / "adapter").iterdir())}
    hooks = {}
    for mode, extra in (("weights", []), ("adapter", ["serve.adapter=true"])):
        cfg = serve_cfg(url, extra)
        probe = VLLMEngine(url).probe(adapter=cfg.adapter)
        hooks[mode] = ServeHook(cfg, initial_states(cfg, {url: probe}, cands[0].parent), f"bench-{mode}")
        _commit(hooks[mode], cands[0], url)  # not counted: the agent imports the package meanwhile (before step 1)
    served = {m: [] for m in hooks}
    paused = {m: [] for m in hooks}
    calls = {m: [] for m in hooks}
    for rep in range(ns.reps):
        snap = cands[(rep + 1) % 2]
        for mode in (("weights", "adapter") if rep % 2 == 0 else ("adapter", "weights")):
            quiet = C.wait_quiet(max_wait=20)
            e = _commit(hooks[mode], snap, url)
            served[mode].append(e["served_s"])
            paused[mode].append(round(e["resumed_unix"] - e["paused_unix"], 4) if "pause_s" in e else 0.0)
            calls[mode].append({k: e.get(k) for k in ("verify_s", "pause_s", "reload_s", "load_s", "unload_s",
                                                      "served_s")} | {"others_busy_percent": quiet.get("busy_percent")})
            print(f"{size} LoRA rep {rep} {mode}: commit to served {served[mode][-1]:.3f} s, paused "
                  f"{paused[mode][-1]:.3f} s", flush=True)
    for hook in hooks.values():
        hook.close(600)
    w, a = C.median(served["weights"]), C.median(served["adapter"])
    ratio = a / w
    return {"snapshot_bytes": nbytes, "commit_to_served_s": served, "paused_s": paused, "calls": calls,
            "commit_to_served_s_median": {"weights": round(w, 4), "adapter": round(a, 4)},
            "ratio_adapter_over_weights": round(ratio, 4), "engine_paused_in_adapter_mode": any(paused["adapter"]),
            "decode": decode_cost(server, cands[1], ns.reps),
            "met": {"adapter commit_to_served <= 0.1x weights": ratio <= 0.1,
                    "engine never paused in adapter mode": not any(paused["adapter"])}}


def decode_cost(server, snap: Path, reps: int, tokens: int = 32) -> dict:
    """vLLM 0.32's load_inplace defect, measured: ``tokens`` generated on the base, on the adapter loaded once
    (``bench-plain``) and on the same adapter loaded in place (``latest``, as adapter mode loads it), interleaved."""
    from paddle_fullparam_callbacks.consumers.serve.engines import VLLMEngine

    engine = VLLMEngine(server.url, timeout_s=600)
    path = str(snap / "adapter")
    engine.client.call("POST", "/v1/load_lora_adapter", {"lora_name": "bench-plain", "lora_path": path}, text=True)
    engine.client.call("POST", "/v1/load_lora_adapter",
                       {"lora_name": "latest", "lora_path": path, "load_inplace": True}, text=True)
    models = {"base": str(server.model_dir), "adapter": "bench-plain", "adapter_in_place": "latest"}
    seconds = {k: [] for k in models}
    for _ in range(max(reps, 1)):
        for kind, model in models.items():
            t = time.perf_counter()
            engine.client.call("POST", "/v1/completions", {"model": model, "prompt": [1, 37, 101, 7],
                                                           "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
            seconds[kind].append(time.perf_counter() - t)
    engine.client.call("POST", "/v1/unload_lora_adapter", {"lora_name": "bench-plain"}, text=True)
    med = {k: round(C.median(v), 4) for k, v in seconds.items()}
    return {"tokens": tokens, "seconds": seconds, "seconds_median": med,
            "in_place_over_plain": round(med["adapter_in_place"] / med["adapter"], 4),
            "extra_ms_per_token_in_place": round(1000 * (med["adapter_in_place"] - med["adapter"]) / tokens, 3)}


VARIANTS = ("off", "on", "lora-off", "lora-weights", "lora-adapter")
"""The stall children: the plain model with serving off and on (weights mode); a LoRA model (its merged snapshot and
its adapter written either way) with serving off, in weights mode and in adapter mode."""


def child(variant: str, size: str, out: Path, url: str, exports: int, steps: int) -> dict:
    """One training run of ``exports`` exports; serving on (the hook on the commits) or off."""
    C.quiet_logs()

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.consumers.serve.engines import VLLMEngine
    from paddle_fullparam_callbacks.consumers.serve.hook import ServeHook
    from paddle_fullparam_callbacks.consumers.serve.probe import initial_states
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    lora = variant.startswith("lora")
    cfg = load_config(None, [f"output_dir={out}", "retention.keep_last=1", f"serve.url={url}", "serve.timeout_s=120",
                             "serve.reload_timeout_s=600", *(["export.peft_adapter=inside"] if lora else []),
                             *(["serve.adapter=true"] if variant == "lora-adapter" else [])])
    session = ExportSession(cfg, out)
    session.start()
    source = build_model_source(build_lora(size, 13) if lora else build(size, 3), cfg)
    session.prepare(source)
    hook = None
    if variant in ("on", "lora-weights", "lora-adapter"):
        probe = VLLMEngine(url).probe(adapter=cfg.serve.adapter)
        hook = ServeHook(cfg.serve, initial_states(cfg.serve, {url: probe}, out), session.run_id)
        session.committer.on_commit = lambda job: hook.committed(job.name, Path(job.out_dir) / job.name, job.step)
        session.committer.busy = hook.busy
    work = C.TrainingWork(512)
    stalls, train_s, statuses = [], [], []
    for step in range(1, exports + 1):
        t = time.perf_counter()
        session.export(source, step, reason="bench")
        stalls.append(time.perf_counter() - t)
        t_train = time.perf_counter()
        for _ in range(steps):  # one "training step": fixed CPU work, then the trainer event's drain
            work.step()
            if hook is not None:
                td = time.perf_counter()
                statuses += [j.record["status"] for j in hook.drain()]
                stalls[-1] += time.perf_counter() - td
        train_s.append(time.perf_counter() - t_train)
    if hook is not None:
        hook.close(1800)  # the end of training's wait: not a stall of the steps measured
        statuses += [j.record["status"] for j in hook.drain()]
    session.close()
    return {"variant": variant, "stalls": stalls, "train_seconds": train_s, "swaps": statuses}


def stall_runs(size: str, work: Path, url: str, reps: int, exports: int, steps: int) -> dict:
    """Training runs with serving off and on (and a LoRA run's off, weights, adapter), interleaved, against the
    engine at ``url``."""
    runs = {v: [] for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS:
            C.wait_quiet(max_wait=20)
            out = Path(tempfile.mkdtemp(prefix="pfc_serve_stall_", dir=work))
            r = C.run_child([__file__, "--child", v, "--size", size, "--out", str(out / "snaps"), "--url", url,
                             "--exports", str(exports), "--steps", str(steps)], timeout=3600)
            shutil.rmtree(out, ignore_errors=True)
            runs[v].append(r)
            print(f"{size} stall rep {rep} {v:3s}: {[round(x, 3) for x in r['stalls']]} s, training "
                  f"{[round(x, 2) for x in r['train_seconds']]} s, swaps {r['swaps']}", flush=True)
    stall = {v: C.median([s for r in runs[v] for s in r["stalls"]]) for v in runs}
    train = {v: C.median([s for r in runs[v] for s in r["train_seconds"]]) for v in runs}
    ratio = stall["on"] / stall["off"]
    lora = {v: round(stall[f"lora-{v}"] / stall["lora-off"], 4) for v in ("weights", "adapter")}
    served = [s for v in ("on", "lora-weights", "lora-adapter") for r in runs[v] for s in r["swaps"]]
    return {"stall_seconds_median": stall, "stall_ratio_on_vs_off": round(ratio, 4),
            "lora_stall_ratio_vs_off": lora, "training_seconds_median": train,
            "training_slowdown_on_vs_off": round(train["on"] / train["off"], 4),
            "swaps_ok": all(s in ("ok", "skipped") for s in served) and bool(served),
            "met": {"stall on <= 1.05x off": ratio <= 1.05,
                    "LoRA stall adapter mode <= 1.05x off": lora["adapter"] <= 1.05},
            "runs": runs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--size", choices=tuple(SIZES))
    ap.add_argument("--out")
    ap.add_argument("--url")
    ap.add_argument("--sizes", nargs="+", default=C.tiny(list(SIZES), ["tiny"]), choices=tuple(SIZES))
    ap.add_argument("--reps", type=int, default=C.tiny(7, 1))
    ap.add_argument("--restarts", type=int, default=C.tiny(2, 0))
    ap.add_argument("--stall-reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--steps", type=int, default=C.tiny(12, 1), help="training steps between exports")
    ns = ap.parse_args()
    if ns.child:
        print(json.dumps(child(ns.child, ns.size, Path(ns.out), ns.url, ns.exports, ns.steps)))
        return
    C.quiet_logs()
    work = Path(tempfile.mkdtemp(prefix="pfc_bench_serve_"))
    sizes = {}
    try:
        for size in ns.sizes:
            sizes[size] = size_case(size, work / size, ns)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "benchmark": "serve", "reps": ns.reps, "restarts": ns.restarts, "stall_reps": ns.stall_reps,
        "exports_per_run": ns.exports, "steps_between_exports": ns.steps, "sizes": sizes,
        "targets": {"commit_to_served": "<= 1.2x the bare reload + 0.2 s", "stall": "serving on <= 1.05x off",
                    "restart": "served in <= 0.05x a restart's time",
                    "adapter": "a LoRA run's commit to served in adapter mode <= 0.1x weights mode's at 0.7GB; the "
                               "engine never paused"},
        "load_average": os.getloadavg(),
        "notes": ["bare = the engine's own POST /collective_rpc reload_weights of the same kind of snapshot, alone",
                  "commit_to_served = the serve record's served_s: from the commit to the engine's resume answered",
                  "restart = stopping the engine and starting it on a snapshot until /health answers (the engine's "
                  "first start is one sample)", "vLLM 0.32.0 CPU build, float32, --enforce-eager, one engine, started "
                  "with --enable-lora --max-lora-rank 8 (every measurement of a size)",
                  "adapter: a LoRA run (r=8, alpha=16, every projection): its merged weights reloaded (weights mode) "
                  "against its PEFT adapter loaded in place under latest (adapter mode), the same snapshots, "
                  "interleaved; paused_s: how long the engine held its requests"],
    }
    C.write_result(RESULT_PATH, result)
    for size, r in sizes.items():
        s, st, a = r["swap"], r["stall"], r["adapter"]
        print(f"{size}: bare reload {s['bare_reload_s_median']:.3f} s, commit to served {s['commit_to_served_s_median']:.3f} s "
              f"({s['served_vs_bare_bound']:.2f}x the bound), restart {s['restart_s_median']:.1f} s "
              f"(served in {s['served_over_restart']:.4f}x); stall on/off {st['stall_ratio_on_vs_off']:.3f}")
        print(f"{size} LoRA: commit to served {a['commit_to_served_s_median']['adapter']:.3f} s as an adapter, "
              f"{a['commit_to_served_s_median']['weights']:.3f} s reloading the weights "
              f"({a['ratio_adapter_over_weights']:.3f}x); paused in adapter mode: "
              f"{a['engine_paused_in_adapter_mode']}; "
              f"stall vs off: adapter {st['lora_stall_ratio_vs_off']['adapter']:.3f}, weights "
              f"{st['lora_stall_ratio_vs_off']['weights']:.3f}; in-place adapter decode "
              f"{a['decode']['in_place_over_plain']:.2f}x the plain one")


if __name__ == "__main__":
    main()
