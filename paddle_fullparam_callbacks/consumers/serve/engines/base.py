"""What every engine's protocol shares: the HTTP client (a timeout on every call, the API key as a bearer
token), the one error every call raises (:class:`EngineError`, naming the engine, the call and what went
wrong), and the contract a protocol module fills (:class:`Engine`: ``probe`` at start, ``swap`` per snapshot, or
``load_adapter`` per snapshot for a LoRA run served as adapters).

Standard library only: the swap runs in a process of its own (``../swap.py``) that starts in milliseconds,
and this folder is imported there by path, without the package.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

UNREACHABLE, TIMEOUT, REFUSED, MISSING, ANSWER = "unreachable", "timeout", "refused", "missing", "answer"
UNKNOWN = "unknown"  # the weight version an engine is named after a swap that left its weights unknown


class EngineError(Exception):
    """One call to an engine failed. ``kind``: unreachable (nothing answers: refused, reset, no route),
    timeout, refused (an HTTP error status), missing (the endpoint is not there: 404/405), answer (not
    the JSON the call expects)."""

    def __init__(self, url: str, call: str, kind: str, message: str, status: Optional[int] = None, detail: str = ""):
        self.url, self.call, self.kind, self.status, self.detail = url, call, kind, status, detail
        super().__init__(f"{url}: {call}: {message}")


class Client:
    """JSON over HTTP to one engine; every call bounded by a timeout (connect and each read)."""

    def __init__(self, url: str, api_key: Optional[str] = None, timeout_s: float = 30.0):
        self.url, self.timeout_s = url.rstrip("/"), float(timeout_s)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body: Any = None, query: Optional[dict] = None,
             timeout_s: Optional[float] = None, text: bool = False) -> Any:
        """The decoded JSON answer (None for an empty one; with ``text``, an answer that is not JSON is returned as
        text: vLLM's adapter endpoints answer a sentence); EngineError otherwise."""
        where = f"{method} {path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        if method == "POST" and data is None:
            data = b""
        request = urllib.request.Request(self.url + where.split(" ", 1)[1], data=data, method=method,
                                         headers=self._headers)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as e:
            detail = _detail(e)
            kind = MISSING if e.code in (404, 405) else REFUSED
            raise EngineError(self.url, where, kind, f"HTTP {e.code}{': ' + detail if detail else ''}", e.code,
                              detail) from None
        except (socket.timeout, TimeoutError) as e:
            raise EngineError(self.url, where, TIMEOUT, f"no answer within {timeout:g} s") from e
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise EngineError(self.url, where, TIMEOUT, f"no answer within {timeout:g} s") from e
            raise EngineError(self.url, where, UNREACHABLE, f"cannot connect ({reason})") from e
        except (ConnectionError, OSError) as e:  # reset or closed mid-answer (an engine that died)
            raise EngineError(self.url, where, UNREACHABLE, f"the connection failed ({type(e).__name__}: {e})") from e
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            if text:
                return raw.decode("utf-8", "replace").strip()
            raise EngineError(self.url, where, ANSWER, f"answered with something that is not JSON: {raw[:200]!r}") from None


def _detail(e: urllib.error.HTTPError) -> str:
    """The engine's own words from an error answer (its JSON ``error``/``detail``, or the text), short."""
    try:
        raw = e.read(4096)
    except OSError:
        return ""
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:500]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(obj)[:500]


@dataclass
class Probe:
    """What the start learns of an engine (``Engine.probe``)."""

    url: str
    missing: List[str] = field(default_factory=list)  # what this package needs and the engine lacks
    model_root: Optional[str] = None  # the directory the engine loaded at its start, as it sees it
    version: Optional[str] = None  # the name of the weights it serves now
    paused: Optional[bool] = None
    note: str = ""  # how to give the engine what is missing
    model_id: Optional[str] = None  # the name requests give for the engine's base model
    adapters: Dict[str, str] = field(default_factory=dict)  # adapter mode: {name: its directory as the engine sees it}


@dataclass
class Target:
    """Weights for an engine: the snapshot's directory as the engine sees it, and the version to name it."""

    path: str
    version: str


@dataclass
class Adapter:
    """A snapshot's PEFT adapter for one engine: its directory as the engine sees it, the snapshot it comes from
    (``version``), the names to load it under (the stable name first: the one clients request), the names to unload
    once it is loaded, and the snapshot the stable name holds now (what the engine serves if the load fails)."""

    path: str
    version: str
    names: List[str]
    unload: List[str] = field(default_factory=list)
    held: Optional[str] = None


@dataclass
class Refusal:
    """Why an engine would not take an adapter (``Engine.try_adapter``): ``kind`` is one of :data:`REFUSALS`,
    ``message`` the engine's own words, ``hint`` how to start the engine so that it takes it (empty when no start
    option helps)."""

    kind: str
    message: str
    hint: str = ""


NO_LORA, RANK, NOT_FOUND, UNSUPPORTED = "no_lora", "rank", "not_found", "unsupported"
REFUSALS = (NO_LORA, RANK, NOT_FOUND, UNSUPPORTED)
"""LoRA is off; the adapter's rank is above the engine's largest; the engine cannot read the adapter's directory; the
engine's loader refuses what the adapter is (DoRA, a bias, modules to save, a module it has no LoRA for...)."""


@dataclass
class Swap:
    """One engine's switch to a snapshot: the outcome, what it serves now, and each call's seconds."""

    url: str
    ok: bool = False
    version: Optional[str] = None  # served now: the target's, the fallback's (restored), or UNKNOWN
    restored: bool = False  # the reload failed and the fallback was reloaded
    paused: bool = False  # left paused (the resume failed): the next swap resumes it
    # pause_s, reload_s, version_s, resume_s, restore_s; paused_unix, resumed_unix: when the engine held its requests
    seconds: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    loaded: List[str] = field(default_factory=list)  # adapter mode: the names the adapter was loaded under
    unloaded: List[str] = field(default_factory=list)  # adapter mode: the names removed

    def timed(self, name: str, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[f"{name}_s"] = round(self.seconds.get(f"{name}_s", 0.0) + time.perf_counter() - t0, 4)

    def fail(self, message: str) -> None:
        self.ok = False
        self.error = message if not self.error else f"{self.error}; {message}"

    def as_dict(self) -> dict:
        out = {"url": self.url, "ok": self.ok, "version": self.version, "restored": self.restored,
               "left_paused": self.paused, "seconds": self.seconds, "error": self.error}
        if self.loaded or self.unloaded:
            out.update(loaded=self.loaded, unloaded=self.unloaded)
        return out


class Engine:
    """An engine's protocol (one module each): which calls, in which order, and what their errors mean.

    ``probe()`` at start (side-effect free); ``swap(target, fallback)`` switches the engine to ``target``
    without dropping a request, and, when the reload fails, leaves it on ``fallback`` (the last weights it
    served) or says it could not (``Swap.version`` UNKNOWN).

    Adapter mode (a LoRA run, ``serve.adapter``): ``probe(adapter=True)`` proves the engine loads adapters at run
    time; ``try_adapter`` loads one and removes it (the start's proof that the engine takes the run's adapter);
    ``prompt_logprobs`` is what its base model computes (the start's proof that it is the run's base);
    ``load_adapter`` serves a snapshot's adapter under its names, never touching the base weights."""

    NAME = ""
    START_HINT = ""  # how to start the engine so that it has what ``probe`` checks
    ADAPTER_HINT = ""  # the same for adapter mode

    def __init__(self, url: str, api_key: Optional[str] = None, timeout_s: float = 30.0,
                 reload_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.client = Client(self.url, api_key, timeout_s)
        self.timeout_s, self.reload_timeout_s = float(timeout_s), float(reload_timeout_s)

    def probe(self, adapter: bool = False) -> Probe:
        raise NotImplementedError

    def swap(self, target: Target, fallback: Optional[Target]) -> Swap:
        raise NotImplementedError

    def try_adapter(self, path: str, name: str) -> Optional[Refusal]:
        raise NotImplementedError

    def prompt_logprobs(self, ids: List[int], model: str) -> List[float]:
        raise NotImplementedError

    def load_adapter(self, adapter: Adapter) -> Swap:
        raise NotImplementedError
