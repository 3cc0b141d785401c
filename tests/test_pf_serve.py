"""Serving with the real PaddleFormers Trainer and real vLLM servers (vLLM's CPU build, two replicas started
once for the module, with an API key): every snapshot switched into both engines while training goes on and a
client sends requests the whole time; the engines' logprobs then equal transformers' on the last snapshot;
``serve.wait``; a reload that fails half-way (a real one: the engine pointed at a damaged copy through a proxy)
leaves the engine on the snapshot it served before; ``paddle-fullparam serve``; a start refused when nothing
listens or when the snapshots do not fit the engines' model; an engine killed mid-run (last: it stays dead)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import demo_tokenizer, make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.consumers.serve import records
from paddle_fullparam_callbacks.trainer.serving import ServeStartFailed

from _engine import Proxy, reload_of
from _helpers import AtStep, listing, run_cli
from _vllm import MODEL, base_snapshot, start_servers

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]
KEY, KEY_ENV = "pfc-test-key", "PFC_TEST_VLLM_KEY"
IDS = [1, 37, 101, 7, 250, 19, 64, 300, 12, 5]


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two vLLM replicas serving the base snapshot (seed 0), with an API key."""
    tmp = tmp_path_factory.mktemp("engines")
    servers = start_servers(base_snapshot(tmp / "base"), tmp / "logs", 2, api_key=KEY)
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture()
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


class Client:
    """Requests to every engine, back to back from one thread per engine, for as long as training runs:
    (url, start, end, error or None) each."""

    def __init__(self, servers):
        self.servers, self.done, self.stop = servers, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers]
        for t in self.threads:
            t.start()

    def _run(self, server):
        while not self.stop.is_set():
            t0, err = time.time(), None
            try:
                server.call("POST", "/v1/completions", {"model": str(server.model_dir), "prompt": IDS, "max_tokens": 16,
                                                        "temperature": 0, "ignore_eos": True}, timeout=120)
            except Exception as e:  # any failure is what the test counts
                err = f"{type(e).__name__}: {e}"
            self.done.append((server.url, t0, time.time(), err))

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(180)
        return self.done


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


def transformers_logprobs(snapshot: Path):
    out = subprocess.run([os.environ["PFC_HF_PYTHON"], str(Path(__file__).parent / "hf_client" / "prompt_logprobs.py"),
                          str(snapshot), json.dumps(IDS)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def close(a, b, tol=1e-4):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


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
