"""The start's proof, in the evaluation environment: the harness and the extras of the backend import, every named
task is in the task folder (or the harness, with ``builtin_tasks``), and every local data file those tasks read
exists. It prints one JSON line::

    {"lm_eval": "0.4.13", "tasks": {"pfc_choice": "/.../pfc_choice.yaml"}, "problems": [["evaluate.lm_eval.tasks", "..."]]}

``python -m paddle_fullparam_callbacks.consumers.evaluate.lmeval probe --spec JSON``; the training job runs it before
step 1 and raises the first problem as a ConfigError (``check.py``). Offline, like the evaluator.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from .spec import OFFLINE

EXTRAS = {"hf": ("lm_eval.models.huggingface", "torch", "transformers", "accelerate"),
          "engine": ("lm_eval.models.openai_completions", "requests", "aiohttp", "tenacity", "tqdm", "transformers")}
"""What each backend imports: the harness's model module and what its extra ([hf], [api]) brings."""
INSTALL = "pip install 'lm-eval[hf,api]==0.4.13' in that environment (or 'paddle-fullparam-callbacks[lm-eval]')"


def probe(spec: dict) -> dict:
    os.environ.update(OFFLINE)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except Exception as e:  # not installed, or broken
        return {"problems": [["evaluate.python", f"lm-eval cannot be imported there ({type(e).__name__}: {e}); "
                                                 + INSTALL]]}
    problems: List[List[str]] = []
    for module in EXTRAS[spec["backend"]]:
        try:
            importlib.import_module(module)
        except Exception as e:
            problems.append(["evaluate.python", f"{module} cannot be imported there for backend={spec['backend']} "
                                                f"({type(e).__name__}: {e}); " + INSTALL])
            break
    folder = Path(spec["include_path"])
    manager = TaskManager(include_path=str(folder), include_defaults=bool(spec["builtin_tasks"]))
    index = manager.task_index
    where = f"the task folder {folder}" + (" or the harness's built-in tasks" if spec["builtin_tasks"] else "")
    found: Dict[str, str] = {}
    for task in spec["tasks"]:
        if task not in index:
            known = ", ".join(sorted(n for n, e in index.items() if _in(e, folder))[:12]) or "none"
            hint = "" if spec["builtin_tasks"] else "; the harness's own tasks need evaluate.lm_eval.builtin_tasks=true"
            problems.append(["evaluate.lm_eval.tasks", f"task {task!r} is not in {where} (it has: {known}){hint}"])
            continue
        found[task] = str(index[task].yaml_path or "")
        for leaf, entry in _leaves(task, index):
            for path, source in _local_files(entry.cfg or {}, folder):
                if not path.exists():
                    problems.append(["evaluate.lm_eval.tasks", f"task {leaf!r} reads {path}, which does not exist "
                                                               f"({source} in {entry.yaml_path})"])
    return {"lm_eval": getattr(lm_eval, "__version__", "?"), "tasks": found, "problems": problems}


def _in(entry, folder: Path) -> bool:
    try:
        return entry.yaml_path is not None and Path(entry.yaml_path).resolve().is_relative_to(folder.resolve())
    except (OSError, ValueError):
        return False


def _leaves(name: str, index: dict, seen=None) -> Iterable[Tuple[str, object]]:
    """The tasks a name stands for: itself, a group's tasks, a tag's tasks (each once)."""
    seen = set() if seen is None else seen
    if name in seen or name not in index:
        return
    seen.add(name)
    entry = index[name]
    kind = getattr(entry.kind, "name", "")
    if kind == "GROUP":
        for item in (entry.cfg or {}).get("task") or []:
            sub = item.get("task") if isinstance(item, dict) else item
            if isinstance(sub, str):
                yield from _leaves(sub, index, seen)
    elif kind == "TAG":
        for sub in sorted(entry.tags):
            yield from _leaves(sub, index, seen)
    else:
        yield name, entry


def _local_files(cfg: dict, folder: Path) -> Iterable[Tuple[Path, str]]:
    """The local files a task config reads: ``dataset_kwargs.data_files`` (relative ones from the task folder, where
    the evaluator runs) and a ``dataset_path`` that is a path (a hub dataset's name is not checked: offline, it must
    be in the datasets cache)."""
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg.get("dataset_kwargs"), dict) else None
    values = files.values() if isinstance(files, dict) else [files]
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str) and item and "://" not in item and not any(c in item for c in "*?["):
                yield folder / os.path.expanduser(item), "dataset_kwargs.data_files"
    path = cfg.get("dataset_path")
    if isinstance(path, str) and path.startswith(("/", "./", "../", "~")):
        yield folder / os.path.expanduser(path), "dataset_path"
