"""Serving's parts without a trainer or a real engine: the serve section's rules, vLLM's protocol against a
stand-in that behaves as vLLM 0.32 was seen to (``tests/_engine.py``: a failed reload breaks the weights, the
next forward kills the engine), the start's proof and the model fit, and the hook on real committed snapshots
(served, skipped when behind, never sent when damaged, an engine down, the agent killed, the end of training,
what a killed job left). The real vLLM server is in ``tests/test_pf_serve.py``."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _engine import FakeVLLM, reload_of  # noqa: E402
from _snapshots import make_snapshot  # noqa: E402

from paddle_fullparam_callbacks.config import load_config  # noqa: E402
from paddle_fullparam_callbacks.config.schema import ConfigError  # noqa: E402
from paddle_fullparam_callbacks.config.serving import ENGINES, engine_urls  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve import records  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.agent import OUTPUT  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.engines import ENGINES as PROTOCOLS, Target, VLLMEngine  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.engines.base import UNKNOWN  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.fit import fit_problems, read_model_dir  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.hook import EngineState, ServeHook  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.probe import ServeStartFailed, initial_states, prove_engines  # noqa: E402
from paddle_fullparam_callbacks.consumers.serve.recovery import recover  # noqa: E402


@pytest.fixture()
def engine():
    e = FakeVLLM()
    yield e
    e.stop()


def serve_cfg(*urls, more=()):
    return load_config(None, [f"serve.url=[{','.join(urls)}]", "serve.timeout_s=5", "serve.reload_timeout_s=10", *more]).serve


# ---- the serve section ---------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["serve.url=ftp://x"], r"^serve.url: 'ftp://x' is not an engine's base URL"),
    (["serve.url=[http://a:1,http://a:1/]"], r"^serve.url: http://a:1 is named twice"),
    (["serve.url=http://a:1", "serve.engine=sglang"], r"^serve.engine: must be one of vllm; got 'sglang'$"),
    (["serve.path_template=models/{name}"], r"^serve.path_template: must give an absolute path as the engines see it"),
    (["serve.path_template=/m/{nam}"], r"^serve.path_template: '/m/\{nam\}': unknown field \{nam\}; the template may use "
                                       r"\{snapshot\}, \{name\}, \{step\}$"),
    (["serve.api_key_env=$KEY"], r"^serve.api_key_env: must name an environment variable"),
    (["serve.timeout_s=0"], r"^serve.timeout_s: must be a number > 0"),
    (["serve.reload_timeout_s=-1"], r"^serve.reload_timeout_s: must be a number > 0"),
    (["serve.wait_at_end_s=-1"], r"^serve.wait_at_end_s: must be a number >= 0"),
    (["serve.url=http://a:1", "serve.wait=true", "export.timeout_s=600"],
     r"^serve.wait: waits up to 1740 s for a swap .* more than export.timeout_s=600"),
    (["serve.url=http://a:1", "export.format=callable", "export.callable=a:b"],
     r"^serve.url: export.format=callable writes no snapshot to serve$"),
])
def test_bad_serve_keys_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_flag_that_is_not_a_boolean_is_named():
    from types import SimpleNamespace

    from paddle_fullparam_callbacks.config.rules import flags_problem

    names = ("wait", "check_model")
    assert flags_problem("serve", SimpleNamespace(wait=True, check_model=False), names) is None
    assert flags_problem("serve", SimpleNamespace(wait=True, check_model="yes"), names) == (
        "serve.check_model", "must be true or false; got 'yes'")


def test_the_engines_urls_in_every_form_a_recipe_or_a_variable_gives():
    assert engine_urls("http://10.0.0.5:8000/ http://10.0.0.6:8000,https://h/v") == [
        "http://10.0.0.5:8000", "http://10.0.0.6:8000", "https://h/v"]
    cfg = load_config(None, ["serve.url=[http://a:1,http://b:2/]"]).serve
    assert cfg.urls == ["http://a:1", "http://b:2"] and cfg.enabled and not load_config(None, []).serve.enabled
    assert set(ENGINES) == set(PROTOCOLS)  # every name the config accepts has its protocol module


# ---- vLLM's protocol ------------------------------------------------------------------------------
def test_a_swap_pauses_keeping_requests_reloads_names_and_resumes_in_that_order(engine, tmp_path):
    snap = tmp_path / "hf-step-000002"
    snap.mkdir()
    s = VLLMEngine(engine.url, timeout_s=5).swap(Target(str(snap), "hf-step-000002"), None)
    assert s.ok and s.version == "hf-step-000002" and not s.restored and s.error is None
    assert engine.paths("POST") == ["/pause?mode=keep", "/collective_rpc", "/update_weight_version", "/resume"]
    rpc = engine.calls[1][2]
    assert rpc["method"] == "reload_weights" and rpc["kwargs"] == {"weights_path": str(snap)} and rpc["timeout"] > 0
    assert engine.state() == {"version": "hf-step-000002", "paused": False, "weights": str(snap), "broken": False,
                              "dead": False}
    assert set(s.seconds) == {"pause_s", "reload_s", "version_s", "resume_s", "paused_unix", "resumed_unix"}


def test_a_failed_reload_restores_the_last_weights_before_the_engine_resumes(engine, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    engine.fail(reload_of(str(bad)))  # the engine breaks its weights, as vLLM's reload does when it fails
    s = VLLMEngine(engine.url, timeout_s=5).swap(Target(str(bad), "hf-step-000004"), Target(str(good), "hf-step-000002"))
    assert not s.ok and s.restored and s.version == "hf-step-000002" and "the reload of" in s.error
    reloads = [b["kwargs"]["weights_path"] for m, p, b, _ in engine.calls if p == "/collective_rpc"]
    assert reloads == [str(bad), str(good)] and engine.paths("POST")[-1] == "/resume"
    assert engine.state()["version"] == "hf-step-000002" and not engine.state()["broken"]
    # and the engine still answers (vLLM would have died on a forward over broken weights)
    assert VLLMEngine(engine.url).client.call("POST", "/v1/completions", {"prompt": [1]})["weights"] == str(good)


def test_when_the_fallback_fails_too_the_weights_are_named_unknown_and_the_engine_resumed(engine, tmp_path):
    s = VLLMEngine(engine.url, timeout_s=5).swap(Target(str(tmp_path / "gone"), "hf-step-000004"),
                                                 Target(str(tmp_path / "gone-too"), "hf-step-000002"))
    assert not s.ok and not s.restored and s.version == UNKNOWN and "failed too" in s.error
    assert engine.state()["version"] == UNKNOWN and not engine.state()["paused"]  # never left holding requests


def test_an_engine_that_does_not_answer_is_untouched_and_a_hung_one_is_bounded(engine, tmp_path):
    s = VLLMEngine("http://127.0.0.1:9", timeout_s=2).swap(Target(str(tmp_path), "x"), None)
    assert not s.ok and s.version is None and "pause failed, the engine keeps its weights" in s.error
    arrived = engine.hang(reload_of(""))
    t0 = time.monotonic()
    s = VLLMEngine(engine.url, timeout_s=0.5, reload_timeout_s=0.5).swap(Target(str(tmp_path), "x"),
                                                                         Target(str(tmp_path), "y"))
    took = time.monotonic() - t0
    engine.release()
    assert arrived.is_set() and not s.ok and s.version == UNKNOWN and "no answer within" in s.error
    assert took < 10 and engine.paths("POST")[-1] == "/resume"  # every call bounded; the resume still sent


def test_the_probe_names_what_a_vllm_without_dev_mode_lacks(tmp_path):
    plain = FakeVLLM(dev_mode=False)
    try:
        p = VLLMEngine(plain.url).probe()
        assert p.missing == ["/weight_info", "/is_paused", "/collective_rpc", "/update_weight_version", "/pause"]
        assert "VLLM_SERVER_DEV_MODE=1" in p.note and plain.state()["version"] == "default"
        with pytest.raises(ServeStartFailed, match=rf"^serve.url: {plain.url} lacks /weight_info, /is_paused, "
                                                   "/collective_rpc, /update_weight_version, /pause: start vLLM with "
                                                   "VLLM_SERVER_DEV_MODE=1"):
            prove_engines(serve_cfg(plain.url), None)
    finally:
        plain.stop()


# ---- the start's proof -----------------------------------------------------------------------------
def _model_dir(tmp_path, step=1, arch="LlamaForCausalLM"):
    (tmp_path / "engine-model").mkdir()
    snap = make_snapshot(tmp_path / "engine-model", step)
    (snap / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return snap


def test_the_start_proves_every_engine_and_the_fit_of_the_snapshots(tmp_path, monkeypatch):
    root = _model_dir(tmp_path)
    arch, tensors = read_model_dir(root)
    assert arch == "LlamaForCausalLM" and tensors == {f"layers.{i}.w": (4, 8) for i in range(6)}
    good, key = FakeVLLM(root=str(root), api_key="sekrit"), "PFC_TEST_ENGINE_KEY"
    try:
        cfg = serve_cfg(good.url, more=[f"serve.api_key_env={key}"])
        with pytest.raises(ConfigError, match=rf"^serve.api_key_env: names \${key}, which is not set"):
            prove_engines(cfg, (arch, tensors))
        monkeypatch.setenv(key, "wrong")
        with pytest.raises(ServeStartFailed, match=rf"{good.url} refused the key in \${key}"):
            prove_engines(cfg, (arch, tensors))
        monkeypatch.setenv(key, "sekrit")
        probes = prove_engines(cfg, (arch, tensors))
        assert probes[good.url].model_root == str(root) and probes[good.url].version == "default"
        assert [c[1] for c in good.calls][:1] == ["/v1/models"]
        wide = {**tensors, "layers.0.w": (4, 16)}
        with pytest.raises(ServeStartFailed, match=rf"{good.url} serves the model in {root}, which the job's snapshots "
                                                   r"do not fit: 1 tensor\(s\) have other shapes: layers.0.w: the "
                                                   r"snapshots \[4, 16\], the engine \[4, 8\]"):
            prove_engines(cfg, (arch, wide))
        said = []
        with pytest.raises(ServeStartFailed, match=r"^serve.url: .*:9 nothing answers"):  # the other engine is still named
            prove_engines(serve_cfg(good.url, "http://127.0.0.1:9", more=[f"serve.api_key_env={key}"]), (arch, tensors))
        assert good.state()["version"] == "default" and "/pause?mode=keep" not in good.paths()  # proving changed nothing
        far = FakeVLLM(root="/models/not-here")
        assert prove_engines(serve_cfg(far.url), (arch, wide), say=said.append) and "cannot be read from here" in said[0]
        far.stop()
    finally:
        good.stop()


def test_fit_problems_name_each_kind_of_misfit():
    ours = ("LlamaForCausalLM", {"a": (2, 3), "b": (4,)})
    assert fit_problems(ours, ("LlamaForCausalLM", {"a": (2, 3), "b": (4,), "m.rotary_emb.inv_freq": (8,)})) == []
    found = fit_problems(ours, ("Qwen2ForCausalLM", {"a": (2, 3), "c": (1,)}))
    assert found[0] == "the engine serves a Qwen2ForCausalLM, the snapshots hold a LlamaForCausalLM"
    assert "has 1 tensor(s) the snapshots lack (it would keep serving its own): c" in found[1]
    assert found[2] == "the snapshots hold 1 tensor(s) the engine's model does not have: b"


# ---- the hook ----------------------------------------------------------------------------------------
def _hook(cfg, tmp_path, root=None):
    states = {u: EngineState(u, Target(str(root or tmp_path), "default")) for u in cfg.urls}
    return ServeHook(cfg, states, "run-a")


def test_each_committed_snapshot_is_served_on_every_engine_and_recorded(engine, tmp_path):
    other = FakeVLLM()
    try:
        cfg = serve_cfg(engine.url, other.url)
        hook = _hook(cfg, tmp_path)
        snap = make_snapshot(tmp_path, 2)
        hook.committed(snap.name, snap, 2)
        assert hook.wait_for(snap.name, 60)
        job = hook.drain()[0]
        assert job.record["status"] == "ok" and set(job.entries) == {engine.url, other.url}
        for url, e in records.read_all(snap).items():
            assert e["status"] == "ok" and e["version"] == snap.name and e["engine_path"] == str(snap.resolve())
            assert e["served_s"] > 0 and e["reload_s"] >= 0 and e["verify_s"] >= 0 and e["run"] == "run-a"
        assert engine.state()["version"] == other.state()["version"] == snap.name
        assert hook.busy() == {snap.name}  # the engines' fallback from now on: retention keeps it
        assert not (snap / records.WORKDIR).exists() and "hf-step-000002 ok" in (snap / records.LOG).read_text()
        other.stop()  # an engine that dies: the next snapshot tries it again, the other one is served
        snap4 = make_snapshot(tmp_path, 4)
        hook.committed(snap4.name, snap4, 4)
        hook.close(60)
        job = hook.drain()[0]
        assert job.entries[engine.url]["status"] == "ok" and job.entries[other.url]["status"] == "failed"
        assert "pause failed" in job.entries[other.url]["error"] and job.entries[other.url]["version"] is None
        reloads = [b["kwargs"]["weights_path"] for m, p, b, _ in engine.calls if p == "/collective_rpc"]
        assert reloads == [str(snap.resolve()), str(snap4.resolve())]
    finally:
        other.stop()


def test_behind_the_newest_wins_the_others_are_skipped_and_a_damaged_snapshot_is_never_sent(engine, tmp_path):
    hook = _hook(serve_cfg(engine.url), tmp_path)
    arrived = engine.hang(reload_of("hf-step-000002"))
    snaps = [make_snapshot(tmp_path, s) for s in (2, 4, 6, 8)]
    hook.committed(snaps[0].name, snaps[0], 2)
    assert arrived.wait(30)
    for s, step in zip(snaps[1:3], (4, 6)):
        hook.committed(s.name, s, step)
    engine.release()
    assert hook.wait_for(snaps[2].name, 60)
    shard = next(snaps[3].glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    calls_before = len(engine.calls)
    hook.committed(snaps[3].name, snaps[3], 8)
    hook.close(60)
    done = {j.name: j.record for j in hook.drain()}
    assert done[snaps[1].name]["status"] == "skipped" and "hf-step-000006 is served instead" in done[snaps[1].name]["error"]
    assert records.read(snaps[1], engine.url)["status"] == "skipped"
    assert done[snaps[2].name]["status"] == "ok" and done[snaps[3].name]["status"] == "failed"
    assert "failed verification and is not offered to any engine" in records.read(snaps[3], engine.url)["error"]
    assert len(engine.calls) == calls_before and engine.state()["version"] == snaps[2].name  # never sent


def test_a_swap_is_not_cut_by_the_end_of_training_and_a_killed_agent_is_replaced(engine, tmp_path):
    hook = _hook(serve_cfg(engine.url), tmp_path)
    snap2, snap4 = make_snapshot(tmp_path, 2), make_snapshot(tmp_path, 4)
    arrived = engine.hang(reload_of("hf-step-000002"))
    hook.committed(snap2.name, snap2, 2)
    assert arrived.wait(30)
    os.kill(hook.agent.proc.pid, signal.SIGKILL)  # the agent dies mid-swap (the engine stays paused)
    engine.release()
    assert hook.wait_for(snap2.name, 60)
    first = hook.drain()[0]
    assert first.entries[engine.url]["status"] == "failed" and "swap agent ended" in first.entries[engine.url]["error"]
    arrived = engine.hang(reload_of("hf-step-000004"))
    hook.committed(snap4.name, snap4, 4)  # a new agent takes it, and resumes the engine
    assert arrived.wait(30)
    closing = threading.Thread(target=hook.close, args=(0,))
    closing.start()
    time.sleep(0.3)
    assert closing.is_alive()  # the end of training waits for the swap in progress (bounded by its timeouts)
    engine.release()
    closing.join(60)
    assert not closing.is_alive() and hook.drain()[0].record["status"] == "ok"
    assert engine.state()["version"] == snap4.name and not engine.state()["paused"]
    assert hook.agent.proc is None  # the agent saw its input closed and is gone


def test_what_a_killed_job_left_is_recorded_at_the_next_start(engine, tmp_path):
    snap = make_snapshot(tmp_path, 2)
    work = snap / records.WORKDIR
    work.mkdir()
    running = {"snapshot": snap.name, "step": 2, "status": "running", "pid": 2 ** 22 + 7, "host": None,
               "committed_unix": time.time() - 1, "engine_paths": {engine.url: str(snap)}}
    records.write(snap, {engine.url: running})
    (work / OUTPUT).write_text(json.dumps({"swaps": [{"url": engine.url, "ok": True, "version": snap.name,
                                                      "seconds": {"reload_s": 0.1, "done_unix": time.time()}}]}))
    left = recover(None, [(snap.name, 2, snap)], [engine.url])
    assert [j.name for j in left["settled"]] == [snap.name] and not left["adopted"]
    entry = records.read(snap, engine.url)
    assert entry["status"] == "ok" and entry["version"] == snap.name and entry["served_s"] > 0
    snap4 = make_snapshot(tmp_path, 4)
    records.write(snap4, {engine.url: {**running, "snapshot": snap4.name}})
    recover(None, [(snap4.name, 4, snap4)], [engine.url])
    assert "left no result" in records.read(snap4, engine.url)["error"]
    # the first fallback of a new job: the snapshot the engine is named after, as the engine sees it
    states = initial_states(serve_cfg(engine.url, more=["serve.path_template=/models/{name}"]),
                            {engine.url: VLLMEngine(engine.url).probe()}, tmp_path)
    assert states[engine.url].served == Target("/nonexistent/engine-model", "default")
    engine.version = snap4.name
    states = initial_states(serve_cfg(engine.url, more=["serve.path_template=/models/{name}"]),
                            {engine.url: VLLMEngine(engine.url).probe()}, tmp_path)
    assert states[engine.url].served == Target(f"/models/{snap4.name}", snap4.name) and states[engine.url].snapshot == snap4.name


def test_serving_is_switched_on_by_recipes_overrides_and_the_environment_alike(tmp_path):
    from paddle_fullparam_callbacks.trainer.autoattach.settings import RunSettings

    recipe = tmp_path / "serve.yaml"
    recipe.write_text("serve:\n  url: [http://10.0.0.5:8000, http://10.0.0.6:8000/]\n  wait: true\n"
                      "  path_template: /models/{name}\n")
    by_recipe = load_config(str(recipe)).serve
    by_env = RunSettings.from_environ({
        "PADDLE_FULLPARAM_OVERRIDES": "serve.url=[http://10.0.0.5:8000,http://10.0.0.6:8000] serve.wait=true "
                                      "serve.path_template=/models/{name}"}).load_config().serve
    assert by_recipe == by_env and by_env.urls == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"] and by_env.wait
    with pytest.raises(ConfigError, match=r"^serve.url: 'ftp://x' is not an engine's base URL"):
        RunSettings.from_environ({"PADDLE_FULLPARAM_OVERRIDES": "serve.url=ftp://x"}).load_config()


def test_an_engine_that_sees_the_snapshots_elsewhere_reloads_them_from_its_own_path(engine, tmp_path):
    """An engine in a container that mounts the output directory at another path (here a link to it):
    ``serve.path_template`` gives the path the engine reads; the record keeps both."""
    out = tmp_path / "out"
    out.mkdir()
    mount = tmp_path / "mnt-models"
    mount.symlink_to(out)
    cfg = serve_cfg(engine.url, more=[f"serve.path_template={mount}/{{name}}"])
    hook = _hook(cfg, tmp_path)
    snap = make_snapshot(out, 6)
    hook.committed(snap.name, snap, 6)
    hook.close(60)
    entry = hook.drain()[0].entries[engine.url]
    assert entry["status"] == "ok" and entry["engine_path"] == f"{mount}/{snap.name}"
    assert engine.state()["weights"] == f"{mount}/{snap.name}" and engine.state()["version"] == snap.name
    assert records.read(snap, engine.url)["engine_path"] == f"{mount}/{snap.name}"
