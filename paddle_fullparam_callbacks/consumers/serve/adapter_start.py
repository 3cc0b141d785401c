"""The start's proof for a LoRA run served as adapters (``serve.adapter``), after ``probe.py``'s (the engine
answers, its adapter endpoints exist, its model fits the snapshots' names and shapes): for each engine,

1. the adapter name clients request is not its base model's own name (vLLM refuses such a load);
2. it takes the run's adapter: a zero adapter of the run's tensors and ``adapter_config.json`` (rank, targets,
   rsLoRA) is loaded under a name of the job's and removed again, from ``output_dir`` where the engine sees it
   (``serve.path_template``); what the engine refuses is told apart (LoRA off, a rank above its
   ``--max-lora-rank``, a path it cannot read, a variant its loader does not serve) and named;
3. its base model is the run's: its prompt log-probabilities against the run's own forward of its base model
   (every LoRA update off) on the same ids, within ``serve.base_tolerance`` (mean |difference|, nats).

Each problem is ``(recipe key, message)``; ``probe.py`` raises them as one error. Nothing here changes what an
engine serves: the probe's adapter is gone from the engine and from disk before training starts.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ... import _dtypes
from ...config.schema import ServeConfig
from ...config.serving import format_engine_path
from ...export.commit.ownership import delete_marked, is_marked, mark
from .adapters import DIRECTORY, adapter_path
from .engines import Engine, EngineError, Probe
from .engines.base import NO_LORA, NOT_FOUND, RANK

PROBE_DIR = ".fullparam-adapter-probe"
CONFIG_FILE = "adapter_config.json"
TENSOR_FILE = "adapter_model.safetensors"
Problem = Tuple[str, str]


@dataclass
class RunAdapter:
    """What the start knows of the run's adapter: its rank, its tensors ({name: (shape, Paddle dtype)}), its
    ``adapter_config.json``, and the run's base log-probabilities on ``ids`` (None: not computed in this job's
    coordinator, e.g. a model split over ranks; ``no_logprobs`` says why)."""

    rank: int
    tensors: Dict[str, Tuple[tuple, str]]
    config: dict
    ids: List[int] = field(default_factory=list)
    logprobs: Optional[List[float]] = None
    no_logprobs: str = ""

    def describe(self) -> str:
        targets = self.config.get("target_modules") or []
        rs = ", rsLoRA" if self.config.get("use_rslora") else ""
        return f"r={self.rank}, lora_alpha={self.config.get('lora_alpha')}{rs}, targets {', '.join(map(str, targets))}"


def write_zero_adapter(directory: Path, run: RunAdapter) -> None:
    """The run's adapter with every tensor zero: its ``adapter_config.json`` and one safetensors file."""
    directory.mkdir(parents=True)
    header, offset = {}, 0
    for name in sorted(run.tensors):
        shape, dtype = run.tensors[name]
        row = _dtypes.lookup(dtype)
        size = row.itemsize * math.prod(shape)
        header[name] = {"dtype": row.st_code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / TENSOR_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # zeros, without holding them
    (directory / CONFIG_FILE).write_text(json.dumps(run.config, indent=1))


def adapter_problems(cfg: ServeConfig, engines: Dict[str, Engine], probes: Dict[str, Probe], run: RunAdapter,
                     output_dir: Path, run_id: str) -> List[Problem]:
    """Every engine's problems with the run's adapter (see the module)."""
    out: List[Problem] = []
    for url, engine in engines.items():
        if probes[url].model_id == cfg.adapter_name:
            out.append(("serve.adapter_name", f"{url} serves its base model as {cfg.adapter_name!r}: an adapter cannot "
                                              "take the same name; choose another serve.adapter_name"))
    if out:
        return out
    work = _probe_dir(output_dir, run_id)
    try:
        write_zero_adapter(work / DIRECTORY, run)
        path = adapter_path(format_engine_path(cfg.path_template, str(work), work.name, 0))
        for url, engine in engines.items():
            found = _takes(url, engine, path, run, cfg, f"pfc-probe-{run_id}")
            out += found or _same_base(url, engine, probes[url], run, cfg)
    finally:
        delete_marked(work)
    return out


def _probe_dir(output_dir: Path, run_id: str) -> Path:
    work = Path(output_dir).resolve() / PROBE_DIR
    if work.exists() or work.is_symlink():
        if not (work.is_dir() and not work.is_symlink() and is_marked(work)):
            raise FileExistsError(f"{work} exists and is not this package's; left alone")
        delete_marked(work)  # an earlier start's, cut short
    work.mkdir()
    mark(work, run_id)
    return work


def _takes(url: str, engine: Engine, path: str, run: RunAdapter, cfg: ServeConfig, name: str) -> List[Problem]:
    try:
        refusal = engine.try_adapter(path, name)
    except EngineError as e:
        return [("serve.url", f"{url} failed while loading the run's adapter: {e}")]
    if refusal is None:
        return []
    if refusal.kind == NO_LORA:
        return [("serve.adapter", f"{url} has no LoRA enabled ({refusal.message}): {refusal.hint}")]
    if refusal.kind == RANK:
        return [("serve.adapter", f"{url} takes adapters of a lower rank than the run's r={run.rank} "
                                  f"({refusal.message}): {refusal.hint} ({run.rank})")]
    if refusal.kind == NOT_FOUND:
        return [("serve.path_template", f"{url} cannot read the adapter at {path} ({refusal.message}): "
                                        f"{refusal.hint}, {cfg.path_template!r} here; is output_dir where the "
                                        "engine can read it?")]
    return [("serve.adapter", f"{url} refuses the run's adapter ({run.describe()}): {refusal.message} Such a run "
                              "cannot be served as an adapter: serve.adapter=false reloads each snapshot's merged "
                              "weights instead")]


def _same_base(url: str, engine: Engine, probe: Probe, run: RunAdapter, cfg: ServeConfig) -> List[Problem]:
    if run.logprobs is None:
        return []
    try:
        theirs = engine.prompt_logprobs(run.ids, probe.model_id or "")
    except EngineError as e:
        return [("serve.url", f"{url} gave no prompt log-probabilities for the base check: {e}")]
    if len(theirs) != len(run.logprobs):
        return [("serve.url", f"{url} gave {len(theirs)} prompt log-probabilities for {len(run.logprobs)} tokens")]
    diffs = [abs(a - b) for a, b in zip(theirs, run.logprobs)]
    mean = sum(diffs) / len(diffs)
    if mean <= cfg.base_tolerance:
        return []
    return [("serve.adapter", f"{url} serves another base than the run's: on the same {len(run.ids)} tokens its base "
                              f"model's log-probabilities differ from the run's own base (LoRA off) by {mean:.3g} "
                              f"nats on average (at most {max(diffs):.3g}), more than serve.base_tolerance="
                              f"{cfg.base_tolerance:g}; start the engine on the run's base model (docs/serving.md: "
                              "the base the engine starts on)")]


__all__ = ["PROBE_DIR", "RunAdapter", "adapter_problems", "write_zero_adapter"]
