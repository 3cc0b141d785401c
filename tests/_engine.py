"""Serving engines for the serve tests: a stand-in that speaks vLLM 0.32's dev-mode endpoints (no model), and a
proxy that puts the same misbehaviours in front of a real vLLM server.

:class:`FakeVLLM` keeps what vLLM keeps (the weight version, whether it is paused, the directory its weights came
from) and behaves as vLLM was seen to behave here: a reload that fails leaves the weights broken until a reload
succeeds, and the first completion served on broken weights kills the engine (the server stops answering);
``--api-key`` guards only ``/v1/...``. Every call is in ``calls`` as (method, path, body, time).

Misbehaviour, on either: ``fail(match)`` answers matching requests with HTTP 500 (a fake engine's reload then
breaks its weights, as vLLM's does); ``hang(match)`` holds them until :meth:`release` (``arrived`` is set when one
arrives, so a test waits on an event, never a sleep); ``rewrite(match, fn)`` (proxy) changes a request's JSON body
before it is forwarded (e.g. a reload pointed at a damaged copy: a real half-way failure); ``answer(match, status,
obj)`` (proxy) answers in the engine's stead (e.g. the 404 vLLM gives for its adapter endpoints when runtime loading
is off, seen here).
"""
from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, List, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

DEV_PATHS = ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/weight_info", "/is_paused")


class _Rules:
    def __init__(self):
        self.failing: List[Tuple[Callable, int]] = []
        self.hanging: List[Callable] = []
        self.rewrites: List[Tuple[Callable, Callable]] = []
        self.answers: List[Tuple[Callable, int, object]] = []
        self.arrived = threading.Event()
        self._release = threading.Event()

    def fail(self, match: Callable[[str, str, dict], bool], times: int = 1) -> None:
        self.failing.append([match, times])

    def hang(self, match: Callable[[str, str, dict], bool]) -> threading.Event:
        self._release.clear()
        self.arrived.clear()
        self.hanging.append(match)
        return self.arrived

    def rewrite(self, match: Callable[[str, str, dict], bool], fn: Callable[[dict], dict]) -> None:
        self.rewrites.append((match, fn))

    def answer(self, match: Callable[[str, str, dict], bool], status: int, obj) -> None:
        """Answer matching requests with ``status`` and ``obj`` instead of the engine (e.g. vLLM's 404 for an
        endpoint it has not got)."""
        self.answers.append((match, status, obj))

    def release(self) -> None:
        self.hanging.clear()
        self._release.set()

    def applies(self, method: str, path: str, body: dict) -> Tuple[bool, dict]:
        """(fail this request, its body after rewrites); hangs here while a hang rule matches."""
        if any(m(method, path, body) for m in self.hanging):
            self.arrived.set()
            self._release.wait(120)
        for rule in self.failing:
            if rule[1] > 0 and rule[0](method, path, body):
                rule[1] -= 1
                return True, body
        for match, fn in self.rewrites:
            if match(method, path, body):
                body = fn(dict(body))
        return False, body


def reload_of(substring: str = "") -> Callable[[str, str, dict], bool]:
    """Matches a reload whose weights path holds ``substring``."""
    return lambda m, p, b: p.startswith("/collective_rpc") and substring in str((b.get("kwargs") or {}).get("weights_path", ""))


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up (its timeout) is no error here
            super().handle_error(request, client_address)


class _Server:
    def __init__(self, handler_cls):
        self.httpd = _HTTPServer(("127.0.0.1", 0), handler_cls)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.calls: List[Tuple[str, str, dict, float]] = []
        self.rules = _Rules()

    def fail(self, *a, **k):
        return self.rules.fail(*a, **k)

    def hang(self, *a, **k):
        return self.rules.hang(*a, **k)

    def rewrite(self, *a, **k):
        return self.rules.rewrite(*a, **k)

    def answer(self, *a, **k):
        return self.rules.answer(*a, **k)

    def release(self):
        self.rules.release()

    def stop(self) -> None:
        self.rules.release()
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self, method: Optional[str] = None) -> List[str]:
        return [p for m, p, _, _ in self.calls if method is None or m == method]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return {}

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeVLLM(_Server):
    """A vLLM stand-in (see the module). ``lora_rank``: LoRA enabled with that ``--max-lora-rank``; ``runtime_lora``:
    the adapter endpoints exist (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Its adapters (``adapters``: {name: path})
    answer as vLLM 0.32 was seen to: a load reads the adapter's ``adapter_config.json`` (a rank above the largest,
    ``use_dora``, a directory that is not there are refused in vLLM's words) before it replaces one in place; the
    base's prompt log-probabilities are ``base_logprobs(ids)``."""

    def __init__(self, root: str = "/nonexistent/engine-model", dev_mode: bool = True, api_key: Optional[str] = None,
                 lora_rank: int = 0, runtime_lora: bool = True):
        super().__init__(_FakeHandler)
        self.root, self.dev_mode, self.api_key = root, dev_mode, api_key
        self.version, self.paused, self.weights, self.broken, self.dead = "default", False, root, False, False
        self.resumed = threading.Condition()
        self.lora_rank, self.runtime_lora = lora_rank, runtime_lora
        self.adapters: dict = {}
        self.base_logprobs = lambda ids: [-1.0] * (len(ids) - 1)

    def state(self) -> dict:
        return {"version": self.version, "paused": self.paused, "weights": self.weights, "broken": self.broken,
                "dead": self.dead}


class _FakeHandler(_Handler):
    def _route(self, method: str) -> None:
        eng: FakeVLLM = self.server.owner
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        body = self._body() if method == "POST" else {}
        eng.calls.append((method, self.path, body, time.time()))
        if eng.dead:
            self.close_connection = True
            return
        if eng.api_key and path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {eng.api_key}":
            return self._send(401, {"error": "Unauthorized"})
        if path in DEV_PATHS and not eng.dev_mode:
            return self._send(404, {"detail": "Not Found"})
        fail, body = eng.rules.applies(method, self.path, body)
        if method == "GET" and path == "/v1/models":
            cards = [{"id": eng.root, "root": eng.root, "parent": None, "max_model_len": 128}]
            cards += [{"id": n, "root": p, "parent": eng.root} for n, p in eng.adapters.items()]
            return self._send(200, {"object": "list", "data": cards})
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return self._adapter_call(eng, path, body, fail)
        if method == "GET" and path == "/weight_info":
            return self._send(200, {"weight_version": eng.version})
        if method == "GET" and path == "/is_paused":
            return self._send(200, {"is_paused": eng.paused})
        if fail:
            if path == "/collective_rpc":
                eng.broken = True
            return self._send(500, {"error": {"message": f"injected failure of {path}"}})
        if method == "POST" and path == "/pause":
            if query.get("mode") not in (["keep"], ["abort"], ["wait"], None):
                return self._send(422, {"detail": "mode: Input should be 'abort', 'wait' or 'keep'"})
            assert query.get("mode") == ["keep"], query  # this package's swaps keep the requests
            eng.paused = True
            return self._send(200, {"status": "paused"})
        if method == "POST" and path == "/resume":
            with eng.resumed:
                eng.paused = False
                eng.resumed.notify_all()
            return self._send(200, {"status": "resumed"})
        if method == "POST" and path == "/update_weight_version":
            if "new_version" not in body:
                return self._send(422, {"detail": "new_version: Field required"})
            eng.version = body["new_version"]
            return self._send(200, {"success": True, "new_version": eng.version})
        if method == "POST" and path == "/collective_rpc":
            if "method" not in body:
                return self._send(400, {"detail": "Missing 'method' in request body"})
            target = (body.get("kwargs") or {}).get("weights_path", "")
            if body.get("method") != "reload_weights" or not Path(target).is_dir():
                eng.broken = True  # vLLM replaced its weights with placeholders before it failed
                return self._send(500, {"error": {"message": f"cannot reload {target}"}})
            eng.weights, eng.broken = target, False
            return self._send(200, {"results": [None]})
        if method == "POST" and path == "/v1/completions":
            with eng.resumed:
                eng.resumed.wait_for(lambda: not eng.paused, timeout=60)  # mode=keep: held, then served
            if eng.broken:
                eng.dead = True  # vLLM's engine core dies on its first forward over placeholders
                return self._send(500, {"error": {"message": "EngineCore encountered an issue"}})
            model = body.get("model")
            if model in eng.adapters:
                return self._send(200, {"adapter": model, "path": eng.adapters[model]})
            if body.get("prompt_logprobs") is not None:
                ids = body["prompt"]
                rows = [None] + [{str(i): {"logprob": lp}} for i, lp in zip(ids[1:], eng.base_logprobs(ids))]
                return self._send(200, {"choices": [{"prompt_logprobs": rows}]})
            return self._send(200, {"version": eng.version, "weights": eng.weights})
        return self._send(404, {"detail": "Not Found"})

    def _adapter_call(self, eng: "FakeVLLM", path: str, body: dict, fail: bool) -> None:
        if not eng.runtime_lora:
            return self._send(404, {"detail": "Not Found"})
        name, where = body.get("lora_name"), body.get("lora_path")
        if not name or (path == "/v1/load_lora_adapter" and not where):
            return self._send(400, {"error": {"message": "validation error: lora_name, lora_path", "code": 400}})
        if path == "/v1/unload_lora_adapter":
            if fail:
                return self._send(500, {"error": {"message": "injected failure of the unload", "code": 500}})
            if name not in eng.adapters:
                return self._send(404, {"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                                  "type": "NotFoundError", "code": 404}})
            del eng.adapters[name]
            return self._send_text(f"Success: LoRA adapter '{name}' removed successfully.")
        if name in eng.adapters and not body.get("load_inplace"):
            return self._send(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.",
                                              "code": 400}})
        words = None
        config = Path(where) / "adapter_config.json"
        if fail:
            words = "injected failure of the load"
        elif not eng.lora_rank:
            words = "LoRA is not enabled. Use --enable-lora to enable LoRA."
        elif not config.is_file():
            return self._send(404, {"error": {"message": f"Loading lora {name} failed: No adapter found for {where}",
                                              "type": "NotFoundError", "code": 404}})
        else:
            cfg = json.loads(config.read_text())
            if cfg.get("use_dora"):
                words = "vLLM does not yet support DoRA."
            elif int(cfg.get("r", 0)) > eng.lora_rank:
                words = f"LoRA rank {cfg['r']} is greater than max_lora_rank {eng.lora_rank}."
        if words:  # vLLM's own wrapping of its worker's words; the adapter held under the name stays
            return self._send(500, {"error": {"message": f"Call to add_lora method failed: Worker failed with error "
                                                         f"'{words}', please check the stack trace above for the "
                                                         "root cause", "type": "InternalServerError", "code": 500}})
        eng.adapters[name] = where
        return self._send_text(f"Success: LoRA adapter '{name}' added successfully.")

    def _send_text(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")


class Proxy(_Server):
    """The same misbehaviours in front of a real engine at ``upstream`` (everything else forwarded as it is)."""

    def __init__(self, upstream: str):
        super().__init__(_ProxyHandler)
        self.upstream = urlsplit(upstream)


class _ProxyHandler(_Handler):
    def _forward(self, method: str) -> None:
        px: Proxy = self.server.owner
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        px.calls.append((method, self.path, body, time.time()))
        for match, status, obj in px.rules.answers:
            if match(method, self.path, body if isinstance(body, dict) else {}):
                return self._send(status, obj)
        fail, new = px.rules.applies(method, self.path, body if isinstance(body, dict) else {})
        if fail:
            return self._send(500, {"error": {"message": f"injected failure of {self.path}"}})
        if new is not body:
            raw = json.dumps(new).encode()
        conn = http.client.HTTPConnection(px.upstream.hostname, px.upstream.port, timeout=600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        conn.request(method, self.path, body=raw if method == "POST" else None, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    def do_GET(self):
        self._forward("GET")

    def do_POST(self):
        self._forward("POST")
