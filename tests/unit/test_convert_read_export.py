"""``convert`` of a small PaddleFormers flex checkpoint through the reading path (``checkpoints/_reads.py``):
the snapshot's files are byte for byte those of the eager reads (``Checkpoint.read``, a whole array per
tensor), in float32 and cast to bfloat16, with the writer cutting every tensor into many blocks; a rank
file cut short after indexing fails the conversion with a CheckpointError naming it, and nothing is
committed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("paddleformers")

from paddle_fullparam_callbacks.config.recipes import coerce_config  # noqa: E402
from paddle_fullparam_callbacks.convert import prepare as prep  # noqa: E402
from paddle_fullparam_callbacks.convert.checkpoints import CheckpointError  # noqa: E402
from paddle_fullparam_callbacks.export.write import writer  # noqa: E402

LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import paddle
    import paddle.distributed as dist
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("flex")
    paddle.seed(3)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    dist.save_state_dict(model.sharded_state_dict(), str(root / "checkpoint-5" / "model_state"))
    (root / "config.json").write_text(json.dumps(dict(LLAMA, architectures=["LlamaForCausalLM"])))
    return root


def _convert(root: Path, out: Path, overrides=()):
    cfg = coerce_config(None, list(overrides))
    conv = prep.prepare(root / "checkpoint-5", cfg, root / "config.json")
    return prep.export_conversion(conv, out, cfg)


@pytest.mark.parametrize("dtype", ["keep", "bfloat16"])
def test_the_snapshot_is_the_one_of_eager_reads(checkpoint, tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(writer, "_BLOCK_BYTES", 4096)  # many blocks per tensor: rows and transposes read in pieces
    overrides = ["export.max_shard_size=40KB", f"export.dtype={dtype}"]
    lazy = _convert(checkpoint, tmp_path / "lazy", overrides)
    monkeypatch.setattr(prep.CheckpointTensors, "read", lambda self, k, o, s: self.ckpt.read(k, o, s))
    eager = _convert(checkpoint, tmp_path / "eager", overrides)
    files = sorted(p.name for p in eager.path.iterdir() if p.suffix == ".safetensors")
    assert len(files) > 3 and files == sorted(p.name for p in lazy.path.iterdir() if p.suffix == ".safetensors")
    for name in files + ["model.safetensors.index.json"]:
        assert (lazy.path / name).read_bytes() == (eager.path / name).read_bytes(), name


def test_a_rank_file_cut_short_after_indexing_fails_with_a_checkpoint_error_and_commits_nothing(checkpoint, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(checkpoint, root)
    cfg = coerce_config(None, [])
    conv = prep.prepare(root / "checkpoint-5", cfg, root / "config.json")
    data = root / "checkpoint-5" / "model_state" / "0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size * 2 // 3])
    with pytest.raises(CheckpointError, match=r"0_0\.distcp: the block \[.*\] in 0_0\.distcp ends at byte \d+, the file "
                                              r"ended at \d+ \(it changed after it was indexed\?\)"):
        prep.export_conversion(conv, tmp_path / "out", cfg)
    left = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert not any(n.startswith("hf-step") or n == "latest" for n in left), left
