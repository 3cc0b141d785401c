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

import time
from typing import Optional

from .base import MISSING, REFUSED, UNKNOWN, Engine, EngineError, Probe, Swap, Target



class VLLMEngine(Engine):
    NAME = "vllm"
    START_HINT = ("start vLLM with VLLM_SERVER_DEV_MODE=1 in its environment (its pause, resume, collective_rpc "
                  "and weight-version endpoints exist only then)")

    # ---- the start -------------------------------------------------------------------------
    def probe(self) -> Probe:
        """The engine answers (``/v1/models``: also the directory it loaded), has the dev-mode endpoints, and
        names its weights; EngineError when it does not answer or refuses. Nothing is changed on the engine:
        a POST endpoint is proven by a request it must refuse as malformed (400/422), never by a call."""
        p = Probe(self.url, note=self.START_HINT)
        models = self.client.call("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict):
            root = data[0].get("root") or data[0].get("id")
            p.model_root = root if isinstance(root, str) else None
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
