"""Real committed snapshots without Paddle, for the tests of what reads them (verify, retention, consumers)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from paddle_fullparam_callbacks.export import commit
from paddle_fullparam_callbacks.export.commit.manifest import describe_files
from paddle_fullparam_callbacks.export.write import checksum
from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

RUN = "run-a"


def make_snapshot(output_dir: Path, step: int, n: int = 6, shard: int = 200, run: str = RUN, seq=None,
                  adapter_rank: int = 0) -> Path:
    """A real committed snapshot: shards through the writer, index, manifest last, rename; with ``adapter_rank``, a
    PEFT adapter of that rank in ``adapter/`` (one LoRA pair per layer, values the step), listed in the manifest as a
    companion (as a LoRA run's export writes it)."""
    specs = [TensorSpec(f"layers.{i}.w", (4, 8), "float32") for i in range(n)]
    plan = build_export_plan(specs, shard)
    staging = commit.new_staging_dir(output_dir, f"hf-step-{step:06d}", run)
    w = SnapshotWriter(plan, staging)
    for s in specs:
        w.put(s.name, np.full(s.shape, step, np.float32))
    files = {k: (v.bytes, v.digest) for k, v in w.close().items()}
    commit.write_json_durable(staging / commit.INDEX, plan.index())
    files.update(describe_files(staging, [commit.INDEX]))
    manifest = {"manifest_version": 1, "step": step, "num_tensors": n, "created_unix": __import__("time").time(),
                "run": {"id": run, "seq": step if seq is None else seq},
                "files": {k: {"bytes": b, checksum.DEFAULT: h} for k, (b, h) in files.items()}}
    if adapter_rank:
        adapter = _adapter(staging / "adapter", step, n, adapter_rank)
        manifest["model"] = {"companions": {"adapter": {k: {"bytes": b, checksum.DEFAULT: h} for k, (b, h) in
                                                        adapter.items()}}}
    commit.write_json_durable(staging / commit.MANIFEST, manifest)
    return commit.commit_staging(staging, output_dir, f"hf-step-{step:06d}")


def _adapter(directory: Path, step: int, n: int, r: int) -> dict:
    import json

    specs = []
    for i in range(n):
        specs += [TensorSpec(f"base_model.model.layers.{i}.lora_A.weight", (r, 8), "float32"),
                  TensorSpec(f"base_model.model.layers.{i}.lora_B.weight", (4, r), "float32")]
    plan = build_export_plan(specs, 1 << 40, prefix="adapter_model")
    directory.mkdir()
    w = SnapshotWriter(plan, directory)
    for s in specs:
        w.put(s.name, np.full(s.shape, step, np.float32))
    files = {k: (v.bytes, v.digest) for k, v in w.close().items()}
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                               "target_modules": ["w"]}))
    files.update(describe_files(directory, ["adapter_config.json"]))
    return files
