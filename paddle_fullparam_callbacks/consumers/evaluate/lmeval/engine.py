"""The engine backend, in the evaluator's process: which weights the engine serves, watched from before the first
request to after the last, and lm-eval's ``local-completions`` made to score as transformers does.

**The weights.** Serving (``consumers/serve/``) names an engine's weights after the snapshot it loaded (vLLM's
``GET /weight_info``) and writes its record beside the snapshot (``fullparam_serve.json``, one entry per engine).
The evaluation waits, at most ``evaluate.lm_eval.engine_wait_s``, until the engine serves its snapshot (serving runs
beside the evaluations), or until that record says the engine will not (the swap was skipped for a newer snapshot,
failed, or was never started); then it watches the version while the requests run (a poll every half second, and
once more after the last answer). A score counts only if every look saw the snapshot's name: a swap changes the
name before it resumes the engine (pause, reload, name, resume), so no request can have been answered by other
weights under the snapshot's name. A LoRA run served as adapters (``serve.adapter``) leaves the base weights alone:
requests then name the stable adapter, and the engine serves the snapshot while ``GET /v1/models`` says that
adapter was loaded from the snapshot's adapter directory (vLLM names the new directory once the new adapter is in).

**The requests** (:func:`engine_lm`): token ids, not text (the engine would add its own BOS to a string and shift
the scored span by a token), with the BOS the snapshot's tokenizer adds (as transformers' tokenizer does); a
generation comes back as token ids too, decoded with the snapshot's tokenizer and cut at the stop sequences, as the
harness does for transformers (the engine's own text keeps the first token's leading space and holds back
incomplete UTF-8 bytes: scores that compare text would differ).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

SERVE_RECORD = "fullparam_serve.json"  # consumers/serve/records.py's RECORD (a test holds them equal)
POLL_S = 0.5


class EngineDown(Exception):
    """The engine does not answer (or not as vLLM does)."""


class Engine:
    """GETs to one engine (its base URL), with its API key; every call bounded. ``adapter`` (``{"name", "root"}``,
    a LoRA run served as adapters): requests name the adapter, and the engine serves the snapshot ``serves`` names
    while that adapter was loaded from ``root``."""

    def __init__(self, url: str, api_key: Optional[str] = None, timeout_s: float = 10.0,
                 adapter: Optional[dict] = None, serves: str = ""):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.adapter, self.serves = adapter, serves
        self.headers = {"Accept": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                obj = json.loads(answer.read())
        except (OSError, ValueError) as e:  # refused, reset, timed out, an HTTP error, not JSON
            raise EngineDown(f"{self.url}: GET {path}: {getattr(e, 'reason', None) or e}") from e
        if not isinstance(obj, dict):
            raise EngineDown(f"{self.url}: GET {path} answered {str(obj)[:100]!r}")
        return obj

    def version(self) -> str:
        """The snapshot the engine serves: its weights' version, or (adapter mode) ``serves`` while the adapter's
        directory is the snapshot's, else that directory (or a note that no adapter has the name)."""
        if self.adapter is None:
            return str(self.get("/weight_info").get("weight_version"))
        cards = self._cards()
        root = next((c.get("root") for c in cards if c.get("id") == self.adapter["name"] and c.get("parent")), None)
        if root is None:
            return f"(no adapter named {self.adapter['name']})"
        return self.serves if root == self.adapter["root"] else str(root)

    def _cards(self) -> list:
        data = self.get("/v1/models").get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            raise EngineDown(f"{self.url}: GET /v1/models names no model")
        return [c for c in data if isinstance(c, dict)]

    def model(self) -> tuple:
        """(the model requests name: the base model's id, or the adapter's name; the base's max_model_len or None)
        from ``GET /v1/models``."""
        cards = self._cards()
        base = next((c for c in cards if not c.get("parent")), cards[0])
        length = base.get("max_model_len")
        name = self.adapter["name"] if self.adapter else str(base.get("id"))
        return name, length if isinstance(length, int) and length > 0 else None


def serve_entry(snapshot: Path, url: str) -> dict:
    """The snapshot's serve record entry for ``url`` ({} when there is none yet)."""
    try:
        engines = json.loads((Path(snapshot) / SERVE_RECORD).read_text()).get("engines")
    except (OSError, ValueError, AttributeError):
        return {}
    entry = engines.get(url) if isinstance(engines, dict) else None
    return entry if isinstance(entry, dict) else {}


def wait_served(engine: Engine, name: str, snapshot: Path, wait_s: float, clock=time.monotonic) -> Optional[str]:
    """Wait until ``engine`` serves ``name``: None then, else why it never will (or did not within ``wait_s``).
    EngineDown when the engine does not answer."""
    deadline = clock() + wait_s
    while True:
        now = engine.version()
        if now == name:
            return None
        entry = serve_entry(snapshot, engine.url)
        status = entry.get("status")
        if status in ("skipped", "failed", "unfinished"):
            why = {"skipped": "serving skipped it (a newer snapshot was served instead)",
                   "failed": f"its swap into the engine failed ({str(entry.get('error'))[:300]})",
                   "unfinished": "its swap never started (the training ended first)"}[status]
            return f"the engine {engine.url} never served {name}: {why}; it serves {now}"
        if status == "ok" and entry.get("version") == name:
            return f"the engine {engine.url} served {name} and moved on to {now} before the evaluation started"
        if clock() >= deadline:
            return (f"the engine {engine.url} did not serve {name} within evaluate.lm_eval.engine_wait_s={wait_s:g} s "
                    f"(it serves {now}; serve record: {status or 'none yet'})")
        time.sleep(POLL_S)


class Watch:
    """The versions an engine served while the requests ran (a thread polls; :meth:`finish` looks once more)."""

    def __init__(self, engine: Engine, name: str):
        self.engine, self.name = engine, name
        self.seen: List[str] = [name]
        self.down: Optional[str] = None  # the last failed look's error
        self.moved = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="pfc-lmeval-watch", daemon=True)
        self._thread.start()

    def _look(self) -> bool:
        try:
            now = self.engine.version()
        except EngineDown as e:
            self.down = str(e)
            return False
        if now != self.seen[-1]:
            self.seen.append(now)
        return True

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._look()

    def finish(self) -> Optional[str]:
        """None if every look saw ``name`` and the engine answered once more after the last request; else why the
        answers are not (all) the snapshot's. ``down`` says whether the engine stopped answering."""
        self._stop.set()
        self._thread.join()
        answered = self._look()
        self.moved = len(self.seen) > 1
        if self.moved:
            return (f"the engine {self.engine.url} moved from {self.name} to {self.seen[1]} during the evaluation "
                    f"(versions seen: {', '.join(self.seen)}): its answers are not all {self.name}'s")
        if not answered:
            return (f"the engine {self.engine.url} could not be asked what it served after the last request "
                    f"({self.down}): the answers may not be {self.name}'s")
        self.down = None  # a poll that failed and an engine that answered after it: the same weights throughout
        return None


def adds_bos(tokenizer) -> bool:
    """Whether the snapshot's tokenizer puts a BOS before a text (what transformers' scoring sees)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a").input_ids
    return bos is not None and bool(ids) and ids[0] == bos


def engine_lm(url: str, snapshot: str, batch_size: int, engine: Engine):
    """An lm-eval ``local-completions`` model on ``url``'s ``/v1/completions`` that requests token ids with the
    snapshot tokenizer's BOS, and decodes generations as transformers' backend does."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoTokenizer

    model_id, max_model_len = engine.model()
    bos = adds_bos(AutoTokenizer.from_pretrained(snapshot))

    class SnapshotEngineLM(LocalCompletionsAPI):
        """Generations as token ids (``return_token_ids``, the stop sequence included), cut here like transformers'."""

        _stop: List[str] = []

        def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs):
            payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed, eos=eos,
                                              **kwargs)
            if generate:
                self._stop = [s for s in (payload.get("stop") or []) if s]
                payload.update(return_token_ids=True, include_stop_str_in_output=True)
            return payload

        def parse_generations(self, outputs, **kwargs) -> List[str]:
            texts = []
            for out in outputs if isinstance(outputs, list) else [outputs]:
                for choice in sorted(out["choices"], key=lambda c: c["index"]):
                    text = self.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
                    for stop in self._stop:
                        text = text.split(stop)[0]
                    texts.append(text)
            return texts

    return SnapshotEngineLM(base_url=f"{url.rstrip('/')}/v1/completions", model=model_id, tokenizer=snapshot,
                            tokenizer_backend="huggingface", tokenized_requests=True, add_bos_token=bos,
                            max_length=max_model_len or 2048, batch_size=batch_size, num_concurrent=1, max_retries=3,
                            timeout=300)
