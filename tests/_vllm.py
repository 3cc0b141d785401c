"""Real vLLM servers for the serve tests and bench/serve.py: vLLM's CPU build (``requirements/vllm.txt``, an
environment of its own), started as a user starts it for this package (docs/serving.md), on a free loopback
port, with its log in a file.

Start-up takes 40-60 s on 2 idle cores (about 3 minutes beside other work): a test module starts its servers
once, all at the same time, and waits for them together. ``--distributed-executor-backend uni`` keeps the
model in the engine-core process (one Python process fewer to start: 38 s instead of 60 here).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = float(os.environ.get("PFC_VLLM_READY_TIMEOUT_S", "900"))
# head_dim 32 (vLLM's CPU attention takes 32 and up), the demo tokenizer's 512 ids (vLLM's detokenizer fails past them)
MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
IDS = [1, 37, 101, 7, 250, 19, 64, 300, 12, 5]


def base_snapshot(out: Path) -> Path:
    """The snapshot a test's engine starts on: the tiny Llama of :data:`MODEL` (seed 0) with the demo's tokenizer,
    committed into ``out``."""
    from paddle_fullparam_callbacks.cli.demo import demo_tokenizer, make_tiny_llama
    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    cfg = load_config(None, [f"output_dir={out}"])
    session = ExportSession(cfg, out)
    session.start()
    path = session.export(build_model_source(make_tiny_llama(seed=0, **MODEL), cfg, demo_tokenizer()), 0).path
    session.close()
    return path


def transformers_logprobs(snapshot, ids: List[int]):
    """transformers' prompt logprobs of ``ids`` on a snapshot's files (a list of snapshots: one list each), in the hf
    environment (``$PFC_HF_PYTHON``)."""
    what = json.dumps([str(p) for p in snapshot]) if isinstance(snapshot, (list, tuple)) else str(snapshot)
    out = subprocess.run([os.environ["PFC_HF_PYTHON"], str(ROOT / "tests" / "hf_client" / "prompt_logprobs.py"),
                          what, json.dumps(ids)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def close(a, b, tol=1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


class Client:
    """Requests to every engine, back to back from one thread per engine, for as long as training runs:
    (url, start, end, error or None) each; ``model``: the name requests give (default: each engine's base)."""

    def __init__(self, servers, model=None):
        self.servers, self.done, self.stop, self.model = servers, [], threading.Event(), model
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in servers]
        for t in self.threads:
            t.start()

    def _run(self, server):
        while not self.stop.is_set():
            t0, err = time.time(), None
            try:
                server.call("POST", "/v1/completions", {"model": self.model or str(server.model_dir), "prompt": IDS,
                                                        "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                            timeout=120)
            except Exception as e:  # any failure is what the test counts
                err = f"{type(e).__name__}: {e}"
            self.done.append((server.url, t0, time.time(), err))

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(180)
        return self.done


def vllm_python() -> str:
    """The vLLM environment's interpreter: ``$PFC_VLLM_PYTHON`` (make sets it), else ``scripts/env.sh vllm``."""
    env = os.environ.get("PFC_VLLM_PYTHON")
    if env:
        return env
    out = subprocess.run(["bash", str(ROOT / "scripts" / "env.sh"), "vllm"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server --model DIR`` in dev mode, float32, on a free port; the
    time from its start to its first answer on ``/health`` is ``started_s`` (what a restart costs). ``lora_rank``:
    LoRA enabled (``--enable-lora --max-lora-rank R --max-loras N``); ``runtime_lora``: its load and unload
    endpoints on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; by default with LoRA)."""

    def __init__(self, model_dir: Path, log: Path, api_key: Optional[str] = None, max_model_len: int = 128,
                 tokenizer: bool = True, lora_rank: Optional[int] = None, max_loras: int = 4,
                 runtime_lora: Optional[bool] = None):
        self.model_dir, self.log, self.api_key = Path(model_dir), Path(log), api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        env.pop("PYTHONPATH", None)  # the engine's environment is its own; this checkout is not imported there
        argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(max_model_len), "--enforce-eager", "--max-num-seqs", "16",
                "--distributed-executor-backend", "uni"]
        if api_key:
            argv += ["--api-key", api_key]
        if lora_rank:  # LoRA adapters loaded at run time, as docs/serving.md starts vLLM for serve.adapter
            argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
        if runtime_lora or (runtime_lora is None and lora_rank):
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if not tokenizer:  # a model whose vocabulary is larger than the tokenizer's (token ids in, token ids out)
            argv += ["--skip-tokenizer-init"]
        self.t0, self.started_s = time.perf_counter(), None
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> "VLLMServer":
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM on {self.url} exited ({self.proc.returncode}) before it was ready:\n"
                                   + self.log.read_text(errors="replace")[-4000:])
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vLLM on {self.url} not ready after {timeout_s:.0f} s:\n"
                                   + self.log.read_text(errors="replace")[-4000:])
            time.sleep(0.2)
        self.started_s = time.perf_counter() - self.t0
        return self

    def kill(self) -> None:
        """SIGKILL the server and its engine process (its session)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def call(self, method: str, path: str, body=None, timeout: float = 120, raw: bool = False):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = r.read()
        return answer.decode() if raw else json.loads(answer)

    def version(self) -> str:
        return self.call("GET", "/weight_info")["weight_version"]

    def adapters(self) -> dict:
        """{adapter name: the directory it was loaded from}, as ``/v1/models`` lists them."""
        return {c["id"]: c["root"] for c in self.call("GET", "/v1/models")["data"] if c.get("parent")}

    def on_base(self) -> "VLLMServer":
        """Back on the weights it started with, named ``default``, no adapter loaded (a test's clean start)."""
        for name in self.adapters():
            self.call("POST", "/v1/unload_lora_adapter", {"lora_name": name}, raw=True)
        self.call("POST", "/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": str(self.model_dir)}})
        self.call("POST", "/update_weight_version", {"new_version": "default"})
        return self

    def prompt_logprobs(self, ids: List[int], model: Optional[str] = None) -> List[float]:
        """log p(ids[i] | ids[:i]) for i >= 1, as the engine computes them (float32), on its base model or on the
        adapter ``model``."""
        out = self.call("POST", "/v1/completions", {"model": model or str(self.model_dir), "prompt": ids,
                                                    "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        rows = out["choices"][0]["prompt_logprobs"][1:]
        return [row[str(i)]["logprob"] for row, i in zip(rows, ids[1:])]


def start_servers(model_dir: Path, logs: Path, n: int, api_key: Optional[str] = None,
                  options: Optional[List[dict]] = None) -> List[VLLMServer]:
    """``n`` servers of ``model_dir``, started together and waited for together (``options``: each one's further
    :class:`VLLMServer` arguments, e.g. ``lora_rank``)."""
    logs.mkdir(parents=True, exist_ok=True)
    options = options or [{}] * n
    servers = [VLLMServer(model_dir, logs / f"vllm-{i}.log", api_key, **options[i]) for i in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers
