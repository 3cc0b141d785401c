"""A model's description for ``convert``, kept between conversions: what the export takes from the lazily built model.

To convert a checkpoint, ``prepare`` imports the framework's model class named by config.json, builds it under
``paddle.LazyGuard`` and asks it (``models.model_info.build_model_source``) for the parameters' names and global
shapes, the whole model's name mapping, ``config.json``, ``generation_config.json``, the padding row and the
manifest's notes. Importing the class was most of a conversion's fixed cost (0.14-0.16 s of 0.17-0.20 s before the
first checkpoint byte, and 11 MB of memory for a PaddleFormers Llama; issue 42). Those answers depend only on the
model's config, the framework's and this package's code and the export's settings, so after a conversion has
succeeded they are kept in a small JSON file, and a later conversion with the same inputs takes them from there
without the class: the same checks against the checkpoint, the same mapping, the same snapshot bytes.

Where: ``$PADDLE_FULLPARAM_CACHE_DIR`` (``off`` or empty: no cache), else ``$XDG_CACHE_HOME/paddle_fullparam_callbacks
/models`` (``~/.cache/...``). The key hashes config.json, the framework's installed version, this package's version
and its modules' sizes and times (an edited checkout is another package), and the recipe's ``export`` section. A
file that cannot be read or does not fit is ignored (the class is imported as before); nothing else reads it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, Optional

from ..export.source import ModelSource

logger = logging.getLogger("paddle_fullparam_callbacks")
CACHE_ENV = "PADDLE_FULLPARAM_CACHE_DIR"
FORMAT = 1
_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass
class Description:
    """What ``build_model_source`` gave for a model, whole-model mapping included (JSON round trip exact)."""

    class_name: str
    framework: str
    expected: Dict[str, tuple]  # parameter name -> global shape, as the lazy model's sharded state dict says
    aoa_config: Optional[dict]  # the whole model's mapping (ModelSource.mapping_for of ``expected``)
    hf_config: Optional[dict]
    generation_config: Optional[dict]
    padding_rows: Dict[str, int]
    notes: dict  # the manifest's "model" notes the mapping wrote

    def as_json(self) -> dict:
        return {"format": FORMAT, "class": self.class_name, "framework": self.framework,
                "expected": {k: list(v) for k, v in self.expected.items()}, "aoa_config": self.aoa_config,
                "hf_config": self.hf_config, "generation_config": self.generation_config,
                "padding_rows": self.padding_rows, "notes": self.notes}

    @classmethod
    def from_json(cls, obj: dict) -> "Description":
        if obj.get("format") != FORMAT:
            raise ValueError(f"format {obj.get('format')!r}")
        return cls(obj["class"], obj["framework"], {k: tuple(v) for k, v in obj["expected"].items()},
                   obj["aoa_config"], obj["hf_config"], obj["generation_config"], dict(obj["padding_rows"]),
                   dict(obj["notes"]))

    def source(self, tokenizer) -> ModelSource:
        """The ModelSource ``build_model_source`` gave (for a file source: its records come from the checkpoint)."""
        for repair in self.notes.get("mapping_repairs", ()):  # said as the live mapping says them
            logger.warning("%s: %s", self.notes.get("mapping"), repair)
        aoa = self.aoa_config
        return ModelSource(sharded_state_dict=_no_state_dict, aoa_config=aoa, mapping_for=lambda shapes: aoa,
                           hf_config=self.hf_config, generation_config=self.generation_config, tokenizer=tokenizer,
                           framework=self.framework, padding_rows=dict(self.padding_rows), notes=dict(self.notes))


def _no_state_dict():
    raise RuntimeError("a model description has no tensors: its source reads them from the checkpoint")


def describe(model_source: ModelSource, class_name: str, expected: Dict[str, tuple]) -> Description:
    """The description of a source ``build_model_source`` just made from the lazy model (before any export)."""
    aoa = model_source.mapping_for(dict(expected)) if model_source.mapping_for is not None else model_source.aoa_config
    return Description(class_name, model_source.framework, dict(expected), aoa, model_source.hf_config,
                       model_source.generation_config, dict(model_source.padding_rows), dict(model_source.notes))


def cache_dir() -> Optional[Path]:
    chosen = os.environ.get(CACHE_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen).expanduser()
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "paddle_fullparam_callbacks" / "models"


def _code_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*.py")):
        st = p.stat()
        h.update(f"{p.relative_to(_PACKAGE)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def key(framework: str, model_config: dict, export_section: dict) -> str:
    from .._version import __version__

    try:
        version = metadata.version(framework)
    except metadata.PackageNotFoundError:
        version = None
    parts = {"format": FORMAT, "package": __version__, "code": _code_digest(), "framework": [framework, version],
             "config": model_config, "export": export_section}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:40]


def load(key_: str) -> Optional[Description]:
    folder = cache_dir()
    if folder is None:
        return None
    try:
        return Description.from_json(json.loads((folder / f"{key_}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(key_: str, desc: Description) -> None:
    """Kept for the next conversion (atomically; a failure to write is only logged: the cache is an optimisation)."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".desc-", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(desc.as_json(), f)
        os.replace(tmp, folder / f"{key_}.json")
    except (OSError, TypeError, ValueError) as e:
        logger.debug("model description not kept in %s: %s", folder, e)


__all__ = ["CACHE_ENV", "Description", "cache_dir", "describe", "key", "load", "save"]
