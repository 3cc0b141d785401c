"""vLLM's protocol (its dev-mode HTTP endpoints, vLLM 0.32; ``VLLM_SERVER_DEV_MODE=1``).

A swap, in this order:

1. ``POST /pause?mode=keep``: the scheduler stops between steps; requests in flight and new ones wait;
2. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}, "timeout": T}``: every
   worker reads DIR's safetensors into the running model, in place;
3. ``POST /update_weight_version {"new_version": NAME}``: ``GET /weight_info`` names what is served;
4. ``POST /resume``: the kept requests go on, on the new weights.

When the reload fails, the model's weights are not the old ones any more: vLLM 0.32 swaps every parameter
for a placeholder before it reads the files (``initialize_layerwise_reload``), and the first forward pass
after a failed reload kills the engine (seen here: ``onednn_mm ... Meta tensors``, then the engine core
exits). So the fallback (the last weights it served) is reloaded *before* the resume, and named; if that
fails too, the weights are named ``unknown`` and the engine resumed (a paused engine would hold its requests
forever; one whose model is broken fails them, and its supervisor restarts it).

vLLM 0.32 also reloads a directory whose tensors have other shapes without an error, and serves a model
that is not the one it started with: the start's check of the engine's model (``../probe.py``) is what
stops a snapshot that does not fit. Its ``--api-key`` guards only ``/v1/...``: the dev-mode endpoints
answer anyone who reaches them (docs/serving.md says how to keep them off public networks).
"""
from __future__ import annotations

import re
import time
from typing import List, Optional

from .base import (MISSING, NO_LORA, NOT_FOUND, RANK, REFUSED, UNKNOWN, UNSUPPORTED, Adapter, Engine, EngineError,
                   Probe, Refusal, Swap, Target)

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
# vLLM 0.32 wraps the worker's words: "Call to add_lora method failed: Worker failed with error '<words>', please
# check the stack trace above for the root cause"
_WORKER_WORDS = re.compile(r"Worker failed with error '(.*)', please check", re.S)


class VLLMEngine(Engine):
    NAME = "vllm"
    START_HINT = ("start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment (its pause, resume, collective_rpc "
                  "and weight-version endpoints exist only then)")
    ADAPTER_HINT = ("start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (its "
                    "/v1/load_lora_adapter and /v1/unload_lora_adapter exist only then) and --enable-lora "
                    "--max-lora-rank R, R at least the run's LoRA rank")

    # ---- the start -------------------------------------------------------------------------
    def probe(self, adapter: bool = False) -> Probe:
        """The engine answers (``/v1/models``: also the directory it loaded, and the adapters it holds), has the
        endpoints a swap needs (the dev-mode ones; with ``adapter``, the adapter ones) and names its weights;
        EngineError when it does not answer or refuses. Nothing is changed on the engine: a POST endpoint is proven
        by a request it must refuse as malformed (400/422), never by a call."""
        p = Probe(self.url, note=self.ADAPTER_HINT if adapter else self.START_HINT)
        models = self.client.call("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        cards = [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []
        base = [c for c in cards if not c.get("parent")]  # adapters name their base model as their parent
        if base:
            root = base[0].get("root") or base[0].get("id")
            p.model_root = root if isinstance(root, str) else None
            p.model_id = str(base[0].get("id"))
        p.adapters = {str(c.get("id")): str(c.get("root")) for c in cards if c.get("parent")}
        if adapter:  # no pause, no reload: the dev-mode endpoints are not needed
            for path in (LOAD, UNLOAD):
                if not self._exists(path, {}, None):
                    p.missing.append(path)
            return p
        for path in ("/weight_info", "/is_paused"):
            try:
                info = self.client.call("GET", path)
            except EngineError as e:
                if e.kind != MISSING:
                    raise
                p.missing.append(path)
                continue
            if path == "/weight_info":
                p.version = info.get("weight_version") if isinstance(info, dict) else None
            else:
                p.paused = bool(info.get("is_paused")) if isinstance(info, dict) else None
        # /resume sits beside /pause in vLLM's router: it cannot be proven without resuming
        for path, body, query in (("/collective_rpc", {}, None), ("/update_weight_version", {}, None),
                                  ("/pause", None, {"mode": "not-a-mode"})):
            if not self._exists(path, body, query):
                p.missing.append(path)
        return p

    def _exists(self, path: str, body, query) -> bool:
        try:
            self.client.call("POST", path, body, query)
        except EngineError as e:
            if e.kind == MISSING:
                return False
            if e.kind == REFUSED and e.status in (400, 422):  # there, and it refused the malformed request
                return True
            raise
        raise EngineError(self.url, f"POST {path}", "answer", "accepted a malformed request (is it vLLM?)")

    # ---- one snapshot ----------------------------------------------------------------------
    def swap(self, target: Target, fallback: Optional[Target]) -> Swap:
        s = Swap(self.url)
        s.seconds["paused_unix"] = time.time()
        try:
            s.timed("pause", self.client.call, "POST", "/pause", None, {"mode": "keep"})
        except EngineError as e:  # nothing changed on the engine
            s.fail(f"pause failed, the engine keeps its weights: {e}")
            return s
        try:
            s.timed("reload", self._reload, target.path)
        except EngineError as e:
            s.fail(f"the reload of {target.path} failed: {e}")
            self._restore(s, fallback)
        else:
            s.version = target.version
            try:
                s.timed("version", self._name, target.version)
                s.ok = True
            except EngineError as e:
                s.fail(f"the weights of {target.version} are served but could not be named: {e}")
        self._resume(s)
        return s

    def _reload(self, path: str) -> None:
        out = self.client.call("POST", "/collective_rpc",
                               {"method": "reload_weights", "kwargs": {"weights_path": path},
                                "timeout": self.reload_timeout_s},
                               timeout_s=self.reload_timeout_s + self.timeout_s)
        if out is not None and not (isinstance(out, dict) and isinstance(out.get("results"), list)):
            raise EngineError(self.url, "POST /collective_rpc", "answer", f"unexpected answer {str(out)[:200]}")

    def _name(self, version: str) -> None:
        self.client.call("POST", "/update_weight_version", {"new_version": version})

    def _restore(self, s: Swap, fallback: Optional[Target]) -> None:
        """After a failed reload, still paused: the fallback's weights back, and their name."""
        if fallback is not None:
            try:
                s.timed("restore", self._reload, fallback.path)
                s.restored, s.version = True, fallback.version
                s.timed("version", self._name, fallback.version)
                return
            except EngineError as e:
                s.fail(f"reloading {fallback.version} ({fallback.path}) failed too: {e}")
        else:
            s.fail("no earlier weights are known to reload")
        s.restored, s.version = False, UNKNOWN
        try:
            self._name(UNKNOWN)
        except EngineError:
            pass

    def _resume(self, s: Swap) -> None:
        for attempt in (1, 2):
            try:
                s.timed("resume", self.client.call, "POST", "/resume")
                s.seconds["resumed_unix"] = time.time()
                return
            except EngineError as e:
                if attempt == 2:
                    s.paused = True
                    s.fail(f"resume failed, the engine may hold its requests until a later swap resumes it: {e}")

    # ---- adapter mode ----------------------------------------------------------------------
    # vLLM 0.32 defect: an adapter loaded with ``load_inplace`` keeps that flag in the request object every later
    # request naming it carries, and its worker re-reads the adapter from disk at each scheduler step that serves
    # one (``WorkerLoRAManager.add_adapter``: ``... or lora_request.load_inplace``); if the directory is gone by
    # then, the engine core dies (seen here: ``LoRAAdapterNotFoundError``, then every request fails with 500).
    # Nothing from outside clears the flag short of an unload, which would make the name fail for a moment. So the
    # serving hook keeps every directory an engine holds under a name on disk (retention asks it); the cost, one
    # adapter read per step while the name is served, is measured in bench/serve.py.
    def load_adapter(self, adapter: Adapter) -> Swap:
        """The adapter under each of its names (the stable one first, in place: requests naming it go on, the
        next ones get the new weights; the base weights are never touched), then the older names unloaded. ``ok``
        once the stable name serves it (what the other names did is in ``error``); a load of the stable name that
        fails leaves the engine serving what it held (vLLM reads the new adapter before it replaces the old one)."""
        s = Swap(self.url)  # no pause: requests go on throughout
        for i, name in enumerate(adapter.names):
            try:
                s.timed("load", self._load, name, adapter.path)
                s.loaded.append(name)
            except EngineError as e:
                if i == 0:
                    s.version = adapter.held
                    s.fail(f"the load of {adapter.path} as {name!r} failed; the engine keeps serving "
                           f"{adapter.held or 'what it held'} under that name: {_words(e)}")
                    return s
                s.fail(f"the load of {adapter.path} as {name!r} failed: {_words(e)}")
        s.version = adapter.version
        for name in adapter.unload:
            try:
                s.timed("unload", self._unload, name)
                s.unloaded.append(name)
            except EngineError as e:
                s.fail(f"the unload of {name!r} failed: {_words(e)}")
        s.ok = True  # the stable name serves it; a failure of the other names is in ``error``
        return s

    def try_adapter(self, path: str, name: str) -> Optional[Refusal]:
        """Load the adapter at ``path`` under ``name`` and remove it again: None if the engine took it, else why
        not (:class:`Refusal`); EngineError when the engine does not answer."""
        try:
            self._load(name, path)
        except EngineError as e:
            words = _words(e)
            if e.kind in (MISSING, REFUSED) and "No adapter found" in words:
                return Refusal(NOT_FOUND, words, "the engine reads the adapter at the path serve.path_template gives")
            if e.kind != REFUSED:
                raise
            if "LoRA is not enabled" in words:
                return Refusal(NO_LORA, words, self.ADAPTER_HINT)
            if "max_lora_rank" in words:
                return Refusal(RANK, words, "start vLLM with --max-lora-rank at least the adapter's rank")
            return Refusal(UNSUPPORTED, words)
        self._unload(name)
        return None

    def prompt_logprobs(self, ids: List[int], model: str) -> List[float]:
        """log p(ids[i] | ids[:i]) for i >= 1, as ``model`` (the base model's name, or an adapter's) computes them."""
        out = self.client.call("POST", "/v1/completions", {"model": model, "prompt": list(ids), "max_tokens": 1,
                                                           "temperature": 0, "prompt_logprobs": 0})
        try:
            rows = out["choices"][0]["prompt_logprobs"][1:]
            return [float(row[str(i)]["logprob"]) for row, i in zip(rows, ids[1:])]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(self.url, "POST /v1/completions", "answer",
                              f"no prompt log-probabilities in {str(out)[:200]}") from e

    def _load(self, name: str, path: str) -> None:
        # load_inplace: a name already loaded is replaced (a refused load leaves the old adapter); a new one is added
        self.client.call("POST", LOAD, {"lora_name": name, "lora_path": path, "load_inplace": True},
                         timeout_s=self.reload_timeout_s, text=True)

    def _unload(self, name: str) -> None:
        try:
            self.client.call("POST", UNLOAD, {"lora_name": name}, text=True)
        except EngineError as e:
            if not (e.status == 404 and "cannot be found" in e.detail):  # gone already: what an unload wants
                raise


def _words(e: EngineError) -> str:
    """The engine's own words from a failed call (the worker's, where vLLM wraps them)."""
    found = _WORKER_WORDS.search(e.detail or "")
    return found.group(1) if found else (e.detail or str(e))
