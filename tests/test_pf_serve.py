"""Serving with the real PaddleFormers Trainer and real vLLM servers (vLLM's CPU build, two replicas started
once for the module, with an API key; the first with LoRA and its runtime adapter endpoints, the second with the
endpoints but no LoRA): every snapshot switched into both engines while training goes on and a client sends
requests the whole time; the engines' logprobs then equal transformers' on the last snapshot; ``serve.wait``; a
reload that fails half-way (a real one: the engine pointed at a damaged copy through a proxy) leaves the engine on
the snapshot it served before; ``paddle-fullparam serve``; a start refused when nothing listens or when the
snapshots do not fit the engines' model.

A LoRA run served as adapters (``serve.adapter``), on the first engine put back on the base: each snapshot's
adapter loaded while a client naming it never sees a request fail, the engine never paused nor its base reloaded;
its logprobs then equal transformers' on the last merged snapshot, and ``keep_adapters: 2`` shows the last two
steps side by side; the start refused for each case an adapter cannot serve (no LoRA run, LoRA off, a rank above the
engine's, runtime loading off, another base, weights trained outside the adapter, DoRA).

Last, engines killed mid-run (they stay dead): the second in weights mode, then the first in adapter mode."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import demo_tokenizer, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.consumers.serve import records
from paddle_fullparam_callbacks.trainer.serving import ServeStartFailed

from _engine import Proxy, reload_of
from _helpers import AtStep, listing, run_cli
import _vllm
from _vllm import IDS, MODEL, Client, base_snapshot, close, start_servers

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]
KEY, KEY_ENV = "pfc-test-key", "PFC_TEST_VLLM_KEY"


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two vLLM replicas serving the base snapshot (seed 0), with an API key; the first with LoRA (rank up to 8, its
    runtime adapter endpoints on), the second with the adapter endpoints but no LoRA."""
    tmp = tmp_path_factory.mktemp("engines")
    servers = start_servers(base_snapshot(tmp / "base"), tmp / "logs", 2, api_key=KEY,
                            options=[dict(lora_rank=8), dict(runtime_lora=True)])
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture()
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def train(tmp_path, urls, overrides, steps=6, at=None, model=None):
    cb = FullParamExportCallback(None, overrides=[
        f"output_dir={tmp_path / 'snaps'}", f"serve.url=[{','.join(urls)}]", f"serve.api_key_env={KEY_ENV}",
        "trigger.every_n_steps=2", "serve.timeout_s=60", "serve.reload_timeout_s=120", *overrides])
    targs = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, save_steps=1000)
    trainer = make_trainer("paddleformers", model or make_tiny_llama(seed=1, **MODEL), targs, [], tokenizer=demo_tokenizer())
    attach(trainer, cb)
    if at:
        trainer.add_callback(AtStep(at))
    trainer.train()
    return cb


def transformers_logprobs(snapshot):
    return _vllm.transformers_logprobs(snapshot, IDS)


def test_each_snapshot_is_served_by_both_engines_while_a_client_never_sees_a_request_fail(engines, key, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    client = Client(engines)
    cb = train(tmp_path, [s.url for s in engines], ["retention.keep_last=1"], steps=8)
    done = client.finish()
    snaps = tmp_path / "snaps"
    served = [j for j in cb.serving.results if j.record["status"] == "ok"]
    assert [j.name for j in cb.serving.results if j.record["status"] not in ("ok", "skipped")] == []
    assert served and served[-1].name == name(8) and all(s.version() == name(8) for s in engines)
    assert listing(snaps) == [name(8), "latest"]  # retention ran; what an engine was loading was kept meanwhile
    entries = records.read_all(snaps / name(8))
    assert set(entries) == {s.url for s in engines} and all(e["status"] == "ok" and e["version"] == name(8)
                                                             for e in entries.values())
    assert all(e["reload_s"] > 0 and e["served_s"] >= e["reload_s"] for e in entries.values())
    # the client: not one request failed, and requests were in flight while an engine was paused for a swap
    assert [d for d in done if d[3]] == [] and len(done) >= 8
    windows = [(u, e["paused_unix"], e["resumed_unix"]) for j in served for u, e in j.entries.items()]
    assert any(u == url and t0 < p and t1 > r for url, t0, t1, _ in done for u, p, r in windows)
    # what the engines serve is the last snapshot, exactly: their logprobs are transformers' on its files
    expected = transformers_logprobs(snaps / name(8))
    assert all(close(s.prompt_logprobs(IDS), expected) for s in engines)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("served ")]
    assert len(lines) == len(served) and all(s.url in lines[-1] for s in engines)


def test_with_serve_wait_each_export_returns_once_the_engines_serve_it(engines, key, tmp_path):
    seen = {}
    at = {s: (lambda s=s: seen.__setitem__(s, [e.version() for e in engines])) for s in (2, 4)}
    cb = train(tmp_path, [s.url for s in engines], ["serve.wait=true", "export.async_write=true"], steps=4, at=at)
    assert seen == {2: [name(2)] * 2, 4: [name(4)] * 2}
    assert [j.record["status"] for j in cb.serving.results] == ["ok", "ok"]


def test_a_reload_that_fails_half_way_leaves_the_engine_on_the_snapshot_it_served(engines, key, tmp_path):
    proxy = Proxy(engines[0].url)
    damaged = tmp_path / "damaged"

    def point_at_damaged_copy(body):  # a real half-way failure: vLLM swaps its weights out, then a file fails
        src = Path(body["kwargs"]["weights_path"])
        shutil.copytree(src, damaged, dirs_exist_ok=True)
        shard = next(damaged.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        return {**body, "kwargs": {"weights_path": str(damaged)}}

    proxy.rewrite(reload_of(name(4)), point_at_damaged_copy)
    seen = {}
    try:
        cb = train(tmp_path, [proxy.url], ["serve.wait=true"], steps=6,
                   at={4: lambda: seen.update(version=engines[0].version(), lp=engines[0].prompt_logprobs(IDS))})
    finally:
        proxy.stop()
    by = {j.name: j for j in cb.serving.results}
    failed = by[name(4)].entries[proxy.url]
    assert failed["status"] == "failed" and failed["restored"] and failed["version"] == name(2)
    assert "the reload of" in failed["error"] and failed["restore_s"] > 0
    assert seen["version"] == name(2) and close(seen["lp"], transformers_logprobs(tmp_path / "snaps" / name(2)))
    assert by[name(6)].record["status"] == "ok" and engines[0].version() == name(6)  # the next snapshot goes through


def test_paddle_fullparam_serve_offers_a_snapshot_on_disk(engines, key, tmp_path):
    train(tmp_path, [engines[0].url], ["trigger.on_train_end=false"], steps=4)
    out = run_cli("serve", str(tmp_path / "snaps" / name(2)), "--to", engines[0].url, f"serve.api_key_env={KEY_ENV}")
    assert out.returncode == 0, out.stderr
    assert engines[0].version() == name(2) and f"{name(2)}" in out.stdout and " ok " in out.stdout
    assert records.read(tmp_path / "snaps" / name(2), engines[0].url)["status"] == "ok"


def test_the_start_is_refused_before_step_one_when_an_engine_cannot_take_the_snapshots(engines, key, tmp_path):
    before = engines[0].version()
    with pytest.raises(ServeStartFailed, match=r"^serve.url: http://127.0.0.1:9 nothing answers"):
        train(tmp_path / "a", [engines[0].url, "http://127.0.0.1:9"], [])
    with pytest.raises(ServeStartFailed, match=rf"{engines[0].url} serves the model in .*, which the job's snapshots do "
                                               r"not fit: .* tensor\(s\) have other shapes: model.layers.0.mlp.down_proj"
                                               r".weight: the snapshots \[128, 384\], the engine \[128, 256\]"):
        train(tmp_path / "b", [engines[0].url], [], model=make_tiny_llama(seed=1, **{**MODEL, "intermediate_size": 384}))
    assert not (tmp_path / "a" / "snaps").exists() and not (tmp_path / "b" / "snaps").exists()
    assert engines[0].version() == before  # nothing was sent


def test_an_engine_left_paused_by_a_killed_swap_gets_the_newest_snapshot_at_the_next_start(tmp_path, caplog):
    """The stand-in (no real engine needed): a swap agent killed with `kill -9` between the pause and the resume
    leaves the engine holding its requests; the next job's start notices and serves the newest snapshot."""
    from _engine import FakeVLLM

    engine = FakeVLLM()
    try:
        train(tmp_path, [engine.url], ["serve.api_key_env=null", "trigger.on_train_end=false"], steps=2)
        assert engine.state()["version"] == name(2)
        engine.paused = True  # what a swap cut after its pause leaves
        caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
        cb = train(tmp_path, [engine.url], ["serve.api_key_env=null", "trigger.every_n_steps=3",
                                            "trigger.on_train_end=false"], steps=3)
    finally:
        engine.stop()
    assert any(engine.url in r.getMessage() and "paused" in r.getMessage() and name(2) in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert [j.name for j in cb.serving.results] == [name(2), name(3)] and not engine.state()["paused"]
    assert engine.state()["version"] == name(3)


# ---- a LoRA run served as adapters --------------------------------------------------------------------------
LORA_TARGETS = [r".*\.(q|k|v|o)_proj", r".*\.(gate|up|down)_proj"]
ADAPTER = ["serve.adapter=true", "serve.wait=true"]


def lora_model(seed=0, model=None, **config):
    """A PaddleFormers LoRAModel on the engine's base (seed 0), lora_B nonzero from the start (zero would make an
    adapter indistinguishable from the base)."""
    from paddleformers.peft import LoRAConfig, LoRAModel

    from _lora_cases import set_nonzero_lora

    lm = LoRAModel(model or make_tiny_llama(seed=seed, **MODEL),
                   LoRAConfig(**{"target_modules": LORA_TARGETS, "r": 4, "lora_alpha": 8, **config}))
    set_nonzero_lora(lm, seed=7)
    return lm


def test_a_lora_run_is_served_as_adapters_while_a_client_naming_it_never_sees_a_failure(engines, key, tmp_path):
    engine = engines[0].on_base()
    base = engine.prompt_logprobs(IDS)
    client = {}
    at = {3: lambda: client.setdefault("c", Client([engine], model="latest"))}  # step 2's adapter is in (serve.wait)
    cb = train(tmp_path, [engine.url], [*ADAPTER, "serve.keep_adapters=2"], steps=8, at=at,
               model=lora_model(r=3, lora_alpha=5))  # an inexact scaling, 5/3
    done = client["c"].finish()
    snaps = tmp_path / "snaps"
    assert [(j.name, j.record["status"]) for j in cb.serving.results] == [(name(s), "ok") for s in (2, 4, 6, 8)]
    entries = {j.name: j.entries[engine.url] for j in cb.serving.results}
    assert all(e["mode"] == "adapter" and e["load_s"] > 0 and "pause_s" not in e for e in entries.values())
    assert entries[name(8)]["loaded"] == ["latest", name(8)] and entries[name(8)]["unloaded"] == [name(4)]
    assert entries[name(8)]["adapters"] == {"latest": name(8), name(6): name(6), name(8): name(8)}
    # the client: not one request failed, and requests were in flight as adapters were loaded
    assert [d for d in done if d[3]] == [] and len(done) >= 4
    assert any(t0 < e["finished_unix"] < t1 for _, t0, t1, _ in done for e in entries.values())
    # the base was never touched: its name and its logprobs are the engine's first ones
    assert engine.version() == "default" and close(engine.prompt_logprobs(IDS), base, 1e-6)
    # the adapters' logprobs are transformers' on the merged snapshots; keep_adapters=2: steps 6 and 8 side by side
    assert engine.adapters() == {"latest": str(snaps / name(8) / "adapter"), name(6): str(snaps / name(6) / "adapter"),
                                 name(8): str(snaps / name(8) / "adapter")}
    six, eight = transformers_logprobs([snaps / name(6), snaps / name(8)])
    assert close(engine.prompt_logprobs(IDS, "latest"), eight) and close(engine.prompt_logprobs(IDS, name(8)), eight)
    assert close(engine.prompt_logprobs(IDS, name(6)), six)
    assert not close(six, eight, 1e-3) and not close(base, eight, 1e-2)  # the steps and the base differ


def test_the_start_is_refused_for_each_run_or_engine_an_adapter_cannot_serve(engines, key, tmp_path, monkeypatch):
    from paddle_fullparam_callbacks.config.schema import ConfigError
    from paddle_fullparam_callbacks.models.lora import adapter as peft

    lora, plain = engines[0].on_base(), engines[1]
    proxy = Proxy(lora.url)  # vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: its adapter endpoints answer 404 (seen)
    proxy.answer(lambda m, p, b: "lora_adapter" in p, 404, {"detail": "Not Found"})
    wider = make_tiny_llama(seed=0, **{**MODEL, "intermediate_size": 384})
    lacks = r"/v1/load_lora_adapter, /v1/unload_lora_adapter: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING="
    cases = {
        "no LoRA run": (lora, make_tiny_llama(seed=0, **MODEL),
                        r"^serve.adapter: the model holds no LoRA layer \(not a LoRA run\)"),
        "LoRA off": (plain, lora_model(), rf"^serve.adapter: {plain.url} has no LoRA enabled \(LoRA is not enabled. "
                                          r"Use --enable-lora to enable LoRA.\): start vLLM with"),
        "rank": (lora, lora_model(r=16, lora_alpha=16),
                 rf"^serve.adapter: {lora.url} takes adapters of a lower rank than the run's r=16 \(LoRA rank 16 is "
                 r"greater than max_lora_rank 8.\)"),
        "runtime off": (proxy, lora_model(), rf"^serve.adapter: {proxy.url} lacks {lacks}"),
        "another base": (lora, lora_model(seed=1),
                         rf"^serve.adapter: {lora.url} serves another base than the run's: on the same 16 tokens"),
        "other shapes": (lora, lora_model(model=wider),
                         rf"^serve.url: {lora.url} serves the model in .*, which the run's base .* does not fit: .* "
                         r"tensor\(s\) have other shapes"),
        "trained outside": (lora, lora_model(trainable_modules=[".*embed_tokens.*"]),
                            r"^serve.adapter: the run trains 1 weight\(s\) outside the adapter \(model.embed_tokens"
                            r".weight: .*set serve.adapter=false"),
        "DoRA": (lora, lora_model(), rf"^serve.adapter: {lora.url} refuses the run's adapter \(r=4, lora_alpha=8, "
                                     r"targets .*\): vLLM does not yet support DoRA. Such a run cannot be served as an "
                                     r"adapter: serve.adapter=false"),
    }
    config = peft.adapter_config
    try:
        for i, (case, (engine, model, message)) in enumerate(cases.items()):
            if case == "DoRA":  # what vLLM's loader refuses (the export writes none: its config says DoRA here)
                monkeypatch.setattr(peft, "adapter_config", lambda *a, **k: {**config(*a, **k), "use_dora": True})
            with pytest.raises(ConfigError, match=message):
                train(tmp_path / str(i), [engine.url], ADAPTER, model=model)
            assert not (tmp_path / str(i) / "snaps").exists(), case  # refused before anything was written
    finally:
        proxy.stop()
    assert lora.adapters() == {} and lora.version() == "default"  # the start's probe adapter is gone again


def test_an_engine_killed_mid_run_never_stops_training_and_is_logged_once(engines, key, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    alive, dead = engines
    cb = train(tmp_path, [alive.url, dead.url], ["serve.wait=true"], steps=8, at={3: dead.kill})
    by = {j.name: j for j in cb.serving.results}
    assert [by[name(s)].entries[dead.url]["status"] for s in (2, 4, 6, 8)] == ["ok", "failed", "failed", "failed"]
    assert all(by[name(s)].entries[alive.url]["status"] == "ok" for s in (2, 4, 6, 8)) and alive.version() == name(8)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and dead.url in r.getMessage()]
    assert len(warnings) == 1 and name(4) in warnings[0] and "training continues" in warnings[0]
    assert cb.errors == [] and (tmp_path / "snaps" / name(8)).is_dir()


def test_an_engine_killed_mid_run_leaves_an_adapter_run_training_and_committing(engines, key, tmp_path):
    engine = engines[0].on_base()
    cb = train(tmp_path, [engine.url], ADAPTER, steps=8, at={3: engine.kill}, model=lora_model())
    by = {j.name: j.entries[engine.url] for j in cb.serving.results}
    assert [by[name(s)]["status"] for s in (2, 4, 6, 8)] == ["ok", "failed", "failed", "failed"]
    assert by[name(4)]["version"] == name(2) and "cannot connect" in by[name(4)]["error"]
    assert cb.errors == [] and [s.step for s in cb.snapshots] == [2, 4, 6, 8]
    assert listing(tmp_path / "snaps") == [name(s) for s in (2, 4, 6, 8)] + ["latest"]
