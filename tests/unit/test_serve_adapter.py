"""A LoRA run served as adapters (``serve.adapter``) and the engine backend's hold (``evaluate.lm_eval.engine_hold``),
without a trainer or a real engine: the keys' rules, vLLM's adapter protocol against the stand-in (``tests/_engine.py``,
which answers as vLLM 0.32 was seen to: its words for LoRA off, a rank too high, DoRA, a directory it cannot read),
the start's proof, and the hook on real committed snapshots (the names, the unloads, what retention keeps, faults,
newest wins, the hold). The real vLLM server is in ``tests/test_pf_serve.py``."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine import FakeVLLM  # noqa: E402
from _snapshots import make_snapshot  # noqa: E402

from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.config.schema import ConfigError  # noqa: E402
from paddle_fullparam_callbacks.config.serving import ADAPTER_DIRECTORY  # noqa: E402
from paddle_fullparam_callbacks.consumers.holds import Holds  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve import adapters, records  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.adapter_start import PROBE_DIR, RunAdapter  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.engines import Adapter, VLLMEngine  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.hook import EngineState, ServeHook  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.probe import (  # noqa: E402
    ServeStartFailed, initial_states, prove_engines,
)

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture()
def engine():
    e = FakeVLLM(root="/models/base", lora_rank=8)
    yield e
    e.stop()


def cfg(*urls, more=()):
    return load_config(None, [f"serve.url=[{','.join(urls)}]", "serve.adapter=true", "serve.timeout_s=5",
                              "serve.reload_timeout_s=10", *more])


def adapter_calls(engine):
    """The adapter calls that did something (the start proves the endpoints by malformed requests, without a name)."""
    return [(p, b.get("lora_name"), b.get("load_inplace")) for m, p, b, _ in engine.calls
            if p in (LOAD, UNLOAD) and b.get("lora_name")]


# ---- the keys ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["serve.adapter=sometimes"], r"^serve.adapter: Value 'sometimes' is not a valid bool"),
    (["serve.adapter=true"], r"^serve.adapter: is true, but serve.url names no engine$"),
    (["serve.url=http://a:1", "serve.keep_adapters=2"], r"^serve.keep_adapters: is set, but serve.adapter is false"),
    (["serve.url=http://a:1", "serve.adapter_name=mine"], r"^serve.adapter_name: is set, but serve.adapter is false"),
    (["serve.url=http://a:1", "serve.adapter=true", "serve.keep_adapters=-1"],
     r"^serve.keep_adapters: must be a whole number >= 0"),
    (["serve.url=http://a:1", "serve.adapter=true", "serve.adapter_name=a/b"],
     r"^serve.adapter_name: must be one word of letters, digits"),
    (["serve.url=http://a:1", "serve.adapter=true", "serve.adapter_name=hf-step-000004"],
     r"^serve.adapter_name: 'hf-step-000004' reads as a snapshot's name"),
    (["serve.url=http://a:1", "serve.adapter=true", "export.format=paddle_safetensors"],
     r"^serve.adapter: loads each snapshot's PEFT adapter, which holds Hugging Face names"),
    (["serve.url=http://a:1", "serve.base_tolerance=0"], r"^serve.base_tolerance: must be a number > 0"),
    (["evaluate.lm_eval.tasks=[pfc_choice]", "evaluate.lm_eval.engine_hold=maybe"],
     r"^evaluate.lm_eval.engine_hold: Value 'maybe' is not a valid bool"),
])
def test_bad_adapter_keys_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_adapter_mode_writes_the_adapter_and_is_switched_on_by_recipes_overrides_and_the_environment(tmp_path):
    from paddle_fullparam_callbacks.trainer.autoattach.settings import RunSettings

    recipe = tmp_path / "r.yaml"
    recipe.write_text("serve:\n  url: http://10.0.0.5:8000\n  adapter: true\n  keep_adapters: 2\n  adapter_name: cur\n")
    by_recipe = load_config(str(recipe))
    overrides = "serve.url=http://10.0.0.5:8000 serve.adapter=true serve.keep_adapters=2 serve.adapter_name=cur"
    by_env = RunSettings.from_environ({"PADDLE_FULLPARAM_OVERRIDES": overrides}).load_config()
    assert by_recipe.serve == by_env.serve and by_env.serve.keep_adapters == 2 and by_env.serve.adapter_name == "cur"
    assert by_recipe.export.peft_adapter == by_env.export.peft_adapter == "inside"  # the mode turns the adapter on
    assert load_config(None, ["serve.url=http://a:1"]).export.peft_adapter == "none"
    from paddle_fullparam_callbacks.models.lora.adapter import DIRECTORY

    assert DIRECTORY == ADAPTER_DIRECTORY  # where the export writes it is where the engines are told to read it


# ---- vLLM's adapter protocol ------------------------------------------------------------------------
def test_an_adapter_goes_under_the_stable_name_in_place_then_its_own_and_older_names_are_unloaded(engine, tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "adapter_config.json").write_text(json.dumps({"r": 4}))
    e = VLLMEngine(engine.url, timeout_s=5)
    s = e.load_adapter(Adapter(str(tmp_path / "a"), "hf-step-000002", ["latest", "hf-step-000002"], []))
    assert s.ok and s.version == "hf-step-000002" and s.loaded == ["latest", "hf-step-000002"] and s.error is None
    engine.adapters["hf-step-000000"] = str(tmp_path / "a")
    s = e.load_adapter(Adapter(str(tmp_path / "b"), "hf-step-000004", ["latest", "hf-step-000004"],
                               ["hf-step-000000", "gone-already"], "hf-step-000002"))
    assert s.ok and s.unloaded == ["hf-step-000000", "gone-already"]  # a name already gone is what an unload wants
    assert adapter_calls(engine) == [(LOAD, "latest", True), (LOAD, "hf-step-000002", True), (LOAD, "latest", True),
                                     (LOAD, "hf-step-000004", True), (UNLOAD, "hf-step-000000", None),
                                     (UNLOAD, "gone-already", None)]
    assert engine.adapters == {"latest": str(tmp_path / "b"), "hf-step-000002": str(tmp_path / "a"),
                               "hf-step-000004": str(tmp_path / "b")}
    assert not [p for p in engine.paths("POST") if p.startswith(("/pause", "/collective_rpc", "/resume"))]  # no pause
    assert set(s.seconds) == {"load_s", "unload_s"}


def test_a_refused_load_leaves_the_stable_name_on_what_it_held_and_goes_no_further(engine, tmp_path):
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "adapter_config.json").write_text(json.dumps({"r": 16}))
    engine.adapters["latest"] = "/old/adapter"
    s = VLLMEngine(engine.url).load_adapter(Adapter(str(tmp_path / "big"), "hf-step-000006",
                                                    ["latest", "hf-step-000006"], ["hf-step-000002"], "hf-step-000004"))
    assert not s.ok and s.version == "hf-step-000004" and s.loaded == [] and s.unloaded == []
    assert ("the engine keeps serving hf-step-000004 under that name: LoRA rank 16 is greater than max_lora_rank 8."
            in s.error)
    assert adapter_calls(engine) == [(LOAD, "latest", True)] and engine.adapters == {"latest": "/old/adapter"}


def test_the_engine_says_why_it_would_not_take_an_adapter(engine, tmp_path):
    good, dora, big = (tmp_path / n for n in ("good", "dora", "big"))
    for d, c in ((good, {"r": 8}), (dora, {"r": 4, "use_dora": True}), (big, {"r": 16})):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(c))
    e = VLLMEngine(engine.url)
    assert e.try_adapter(str(good), "probe") is None and engine.adapters == {}  # loaded, then removed
    assert (e.try_adapter(str(dora), "probe").kind, e.try_adapter(str(dora), "probe").message) == (
        "unsupported", "vLLM does not yet support DoRA.")
    assert e.try_adapter(str(big), "probe").kind == "rank"
    assert e.try_adapter(str(tmp_path / "nowhere"), "probe").kind == "not_found"
    off = FakeVLLM(lora_rank=0)
    try:
        refusal = VLLMEngine(off.url).try_adapter(str(good), "probe")
        assert refusal.kind == "no_lora" and "--enable-lora" in refusal.hint
    finally:
        off.stop()


# ---- the start ------------------------------------------------------------------------------------------
def run_adapter(r=4, logprobs=(-1.0, -2.0, -3.0)):
    tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": ((r, 8), "float32"),
               "base_model.model.layers.0.q_proj.lora_B.weight": ((8, r), "float32")}
    return RunAdapter(r, tensors, {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"]},
                      [1, 5, 9, 13], list(logprobs) if logprobs is not None else None)


def test_the_start_loads_a_zero_adapter_of_the_run_and_compares_the_base(engine, tmp_path):
    engine.base_logprobs = lambda ids: [-1.0, -2.0, -3.01]
    c = cfg(engine.url).serve
    probes = prove_engines(c, None, adapter=run_adapter(), output_dir=tmp_path, run_id="run-a")
    assert probes[engine.url].model_id == "/models/base" and engine.adapters == {}
    probe_dir = str(tmp_path.resolve() / PROBE_DIR / "adapter")
    assert adapter_calls(engine) == [(LOAD, "pfc-probe-run-a", True), (UNLOAD, "pfc-probe-run-a", None)]
    load = next(b for m, p, b, _ in engine.calls if p == LOAD and b.get("lora_name"))
    assert load["lora_path"] == probe_dir and not (tmp_path / PROBE_DIR).exists()  # gone from disk too
    assert [p for m, p, b, _ in engine.calls][-1] == "/v1/completions"
    engine.base_logprobs = lambda ids: [-1.5, -2.5, -3.5]
    with pytest.raises(ServeStartFailed, match=rf"^serve.adapter: {engine.url} serves another base than the run's: "
                                               r"on the same 4 tokens .* by 0.5 nats on average \(at most 0.5\), more "
                                               r"than serve.base_tolerance=0.05"):
        prove_engines(c, None, adapter=run_adapter(), output_dir=tmp_path, run_id="run-a")
    with pytest.raises(ServeStartFailed, match=rf"^serve.adapter: {engine.url} takes adapters of a lower rank than the "
                                               r"run's r=16 \(LoRA rank 16 is greater than max_lora_rank 8.\)"):
        prove_engines(c, None, adapter=run_adapter(r=16), output_dir=tmp_path, run_id="run-a")
    assert not (tmp_path / PROBE_DIR).exists() and engine.adapters == {}


def test_each_engine_that_cannot_take_adapters_is_named_with_its_key(tmp_path):
    off, plain, named = FakeVLLM(lora_rank=0), FakeVLLM(lora_rank=8, runtime_lora=False), FakeVLLM(root="latest",
                                                                                                   lora_rank=8)
    try:
        with pytest.raises(ServeStartFailed, match=rf"^serve.adapter: {off.url} has no LoRA enabled \(LoRA is not "
                                                   r"enabled. Use --enable-lora to enable LoRA.\): start vLLM with"):
            prove_engines(cfg(off.url).serve, None, adapter=run_adapter(), output_dir=tmp_path)
        with pytest.raises(ServeStartFailed, match=rf"^serve.adapter: {plain.url} lacks /v1/load_lora_adapter, "
                                                   r"/v1/unload_lora_adapter: start vLLM with "
                                                   r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            prove_engines(cfg(plain.url).serve, None, adapter=run_adapter(), output_dir=tmp_path)
        with pytest.raises(ServeStartFailed, match=rf"^serve.adapter_name: {named.url} serves its base model as "
                                                   r"'latest'"):
            prove_engines(cfg(named.url).serve, None, adapter=run_adapter(), output_dir=tmp_path)
        with pytest.raises(ServeStartFailed, match=r"^serve.path_template: .* cannot read the adapter at "
                                                   r"/elsewhere/.fullparam-adapter-probe/adapter"):
            prove_engines(cfg(named.url, more=["serve.path_template=/elsewhere/{name}",
                                               "serve.adapter_name=cur"]).serve, None, adapter=run_adapter(),
                          output_dir=tmp_path)
        assert [p for p in plain.paths("POST") if p == LOAD] == [LOAD]  # proven by a malformed request only
        assert plain.adapters == {} and not (tmp_path / PROBE_DIR).exists()
    finally:
        for e in (off, plain, named):
            e.stop()


def test_what_an_engine_holds_at_the_start_is_read_from_its_adapters(engine, tmp_path):
    s2, s4 = make_snapshot(tmp_path, 2, adapter_rank=4), make_snapshot(tmp_path, 4, adapter_rank=4)
    engine.adapters.update({"latest": str(s4 / "adapter"), s2.name: str(s2 / "adapter"), "other": "/x/adapter"})
    c = cfg(engine.url).serve
    states = initial_states(c, {engine.url: VLLMEngine(engine.url).probe(adapter=True)}, tmp_path)
    assert states[engine.url].held == adapters.Held(s4.name, None, [s2.name])
    engine.adapters["latest"] = "/somewhere/else/adapter"
    states = initial_states(c, {engine.url: VLLMEngine(engine.url).probe(adapter=True)}, tmp_path)
    assert states[engine.url].held.stable == "/somewhere/else/adapter"


# ---- the hook --------------------------------------------------------------------------------------------
def adapter_hook(c, states=None, holds=None):
    return ServeHook(c.serve, states or {u: EngineState(u) for u in c.serve.urls}, "run-a", holds=holds)


def test_keep_adapters_two_shows_the_last_two_steps_side_by_side_and_retention_keeps_what_engines_hold(engine,
                                                                                                      tmp_path):
    hook = adapter_hook(cfg(engine.url, more=["serve.keep_adapters=2"]))
    snaps = [make_snapshot(tmp_path, s, adapter_rank=4) for s in (2, 4, 6)]
    for s in snaps:
        hook.committed(s.name, s, int(s.name[-6:]))
        assert hook.wait_for(s.name, 60)
    hook.close(60)
    done = {j.name: j for j in hook.drain()}
    last = done[snaps[2].name].entries[engine.url]
    assert last["status"] == "ok" and last["mode"] == "adapter" and last["adapter"] == "latest"
    assert last["version"] == snaps[2].name and last["loaded"] == ["latest", snaps[2].name]
    assert last["unloaded"] == [snaps[0].name] and last["engine_path"] == str(snaps[2].resolve() / "adapter")
    assert last["adapters"] == {"latest": snaps[2].name, snaps[1].name: snaps[1].name, snaps[2].name: snaps[2].name}
    assert records.read(snaps[2], engine.url)["adapters"] == last["adapters"]
    assert engine.adapters == {"latest": str(snaps[2].resolve() / "adapter"), snaps[1].name: str(snaps[1].resolve() /
                               "adapter"), snaps[2].name: str(snaps[2].resolve() / "adapter")}
    # retention keeps every directory the engine may still read: the two own names and the stable name's last two
    assert hook.busy() == {snaps[1].name, snaps[2].name}
    assert "pause_s" not in last and engine.state()["version"] == "default"  # never paused, the weights untouched


def test_only_the_adapter_is_verified_and_a_damaged_one_is_never_loaded(engine, tmp_path):
    hook = adapter_hook(cfg(engine.url))
    s2, s4 = make_snapshot(tmp_path, 2, adapter_rank=4), make_snapshot(tmp_path, 4, adapter_rank=4)
    shard = next(s2.glob("model-*.safetensors"))  # the weights: never read in adapter mode
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x01")
    hook.committed(s2.name, s2, 2)
    assert hook.wait_for(s2.name, 60)
    tensor = s4 / "adapter" / "adapter_model.safetensors"
    tensor.write_bytes(tensor.read_bytes()[:-1] + b"\x01")
    hook.committed(s4.name, s4, 4)
    hook.close(60)
    done = {j.name: j.entries[engine.url] for j in hook.drain()}
    assert done[s2.name]["status"] == "ok" and done[s2.name]["verify_s"] >= 0
    assert done[s4.name]["status"] == "failed" and "failed verification" in done[s4.name]["error"]
    assert "adapter_model.safetensors: blake3 differs" in done[s4.name]["error"]
    assert engine.adapters == {"latest": str(s2.resolve() / "adapter")}


def test_an_engine_down_or_refusing_is_recorded_and_the_next_snapshot_tries_again(engine, tmp_path):
    other = FakeVLLM(lora_rank=8)
    hook = adapter_hook(cfg(engine.url, other.url))
    s2, s4, s6 = (make_snapshot(tmp_path, s, adapter_rank=4) for s in (2, 4, 6))
    try:
        engine.fail(lambda m, p, b: p == LOAD and "000004" in b.get("lora_path", ""))
        for s in (s2, s4):
            hook.committed(s.name, s, int(s.name[-6:]))
            assert hook.wait_for(s.name, 60)
        other.stop()
        hook.committed(s6.name, s6, 6)
        hook.close(60)
        done = {j.name: j.entries for j in hook.drain()}
    finally:
        other.stop()
    refused = done[s4.name][engine.url]
    assert refused["status"] == "failed" and refused["version"] == s2.name  # it keeps serving the adapter it held
    assert refused["adapters"] == {"latest": s2.name} and "injected failure of the load" in refused["error"]
    assert done[s4.name][other.url]["status"] == "ok"
    assert done[s6.name][engine.url]["status"] == "ok" and done[s6.name][other.url]["status"] == "failed"
    assert engine.adapters["latest"] == str(s6.resolve() / "adapter")


def test_the_hold_makes_the_next_swap_wait_for_the_evaluation_and_the_newest_waiting_wins(engine, tmp_path):
    holds = Holds()
    hook = adapter_hook(cfg(engine.url), holds=holds)
    s2, s4, s6, s8 = (make_snapshot(tmp_path, s, adapter_rank=4) for s in (2, 4, 6, 8))
    holds.hold(s2.name)  # its evaluation is in line (the evaluation hook holds before the serving hook hears)
    hook.committed(s2.name, s2, 2)
    assert hook.wait_for(s2.name, 60) and engine.adapters["latest"].startswith(str(s2.resolve()))
    for s in (s4, s6):
        hook.committed(s.name, s, int(s.name[-6:]))
    assert hook.wait_for(s6.name, 60)  # serve.wait: returns at once, held back (training never waits on a hold)
    with hook._cond:
        assert hook.held_back(s6.name)
    assert engine.adapters["latest"].startswith(str(s2.resolve()))  # the engine stays on step 2
    landed = threading.Event()
    holds.on_release(landed.set)
    holds.release(s2.name)  # the evaluation of step 2 is over
    assert landed.wait(10)
    hook.committed(s8.name, s8, 8)
    hook.close(60)
    done = {j.name: j.record for j in hook.drain()}
    assert done[s4.name]["status"] == "skipped" and done[s6.name]["status"] in ("ok", "skipped")
    assert done[s8.name]["status"] == "ok" and engine.adapters["latest"].startswith(str(s8.resolve()))
    loads = [b["lora_path"] for m, p, b, _ in engine.calls if p == LOAD]
    assert str(s4.resolve() / "adapter") not in loads  # skipped, never loaded


def test_the_evaluation_hook_holds_each_snapshot_until_its_evaluation_lands(tmp_path):
    from paddle_fullparam_callbacks.consumers.evaluate import EvaluationHook

    holds = Holds()
    c = load_config(None, ["evaluate.command={python} -c pass", "evaluate.timeout_s=60"]).evaluate
    hook = EvaluationHook(c, [sys.executable], holds=holds)
    s2 = make_snapshot(tmp_path, 2)
    released = threading.Event()
    holds.on_release(released.set)
    hook.committed(s2.name, s2, 2)
    assert holds.held(s2.name) or released.is_set()
    assert released.wait(60) and not holds.held(s2.name)
    hook.close(60)
    assert [j.name for j in hook.drain()] == [s2.name]  # landed (its outcome is no matter here)
    late = make_snapshot(tmp_path, 4)
    hook.committed(late.name, late, 4)  # after the end: never in line, never held
    assert not holds.held(late.name)


def test_paddle_fullparam_serve_loads_a_snapshot_on_disk_as_an_adapter(engine, tmp_path):
    from paddle_fullparam_callbacks.consumers.serve.offline import serve_path

    snap = make_snapshot(tmp_path, 4, adapter_rank=4)
    job = serve_path(snap, cfg(engine.url, more=["serve.keep_adapters=1", "serve.check_model=false"]),
                     say=lambda _: None)
    entry = job.entries[engine.url]
    assert entry["status"] == "ok" and entry["loaded"] == ["latest", snap.name] and entry["mode"] == "adapter"
    assert engine.adapters == {"latest": str(snap.resolve() / "adapter"), snap.name: str(snap.resolve() / "adapter")}
    assert records.read(snap, engine.url)["adapters"] == {"latest": snap.name, snap.name: snap.name}
