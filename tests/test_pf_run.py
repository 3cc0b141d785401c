"""``paddle-fullparam run -- paddleformers-cli train`` on CPU, with this checkout (the hook's folder first
on PYTHONPATH), on the example of ``examples/paddleformers_cli/sft_cpu.yaml`` and a tiny Llama made by
``examples/make_tiny_llama.py``: 4 steps, a snapshot every 2. The CLI re-launches itself under
``python -m paddle.distributed.launch``: the Trainer is built in the launched rank, two processes below
``run``. Three launches, each checking many things:

* full SFT, ``run --recipe hf_every_n_steps trigger.every_n_steps=2 export.dtype=keep``: snapshots of steps 2
  and 4 in ``<output_dir>/fullparam``, verified, loaded by transformers with their tokenizer (greedy
  generation), the step-4 one with the logits of the model the CLI saved at the end (<= 1e-4); one
  callback, one log line in the rank, ``run``'s summary; the CLI's own parent process built no Trainer.
* LoRA SFT (PaddleFormers' default), recipe and overrides from ``PADDLE_FULLPARAM_*`` plus ``--output-dir``:
  merged snapshots whose logits are those of the LoRA model the CLI saved.
* pretraining (``stage=PT``, ``{"text"}`` lines) with the ``checkpoint_hook`` recipe: each trainer
  ``checkpoint-N/`` holds its snapshot in ``hf/``.

DPO through the CLI does not run on CPU (docs/without-code.md): one process fails in DPOTrainer
(``fleet.distributed_model`` without ``fleet.init``), two ranks in ``TrainingArguments``' ``fleet.init``.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks import verify_snapshot

from _helpers import paddle_logits, run_hf_client, snapshot_tensors, use_snapshots

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow, pytest.mark.hf_client]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "paddleformers_cli"
DATA = EXAMPLE / "data"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_llama.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def _cli(tmp_path: Path, model: Path, run_args, yaml_overrides, env_extra=None):
    """``run [run_args] -- paddleformers-cli train sft_cpu.yaml [yaml_overrides]`` from ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_")}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]), CUDA_VISIBLE_DEVICES="0",
               PADDLEFORMERS_DIST_LOG=str(tmp_path / "distlog"), MASTER_PORT=str(_free_port()), **(env_extra or {}))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "paddle_fullparam_callbacks", "run", *run_args, "--", "paddleformers-cli", "train",
           str(EXAMPLE / "sft_cpu.yaml"), f"model_name_or_path={model}", f"output_dir={out}",
           f"train_dataset_path={DATA / 'sft_train.jsonl'}", f"eval_dataset_path={DATA / 'sft_eval.jsonl'}",
           *yaml_overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    rank_log = (tmp_path / "distlog" / "workerlog.0").read_text(errors="replace") \
        if (tmp_path / "distlog" / "workerlog.0").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + rank_log[-5000:]
    return proc, rank_log, out


def _hook_lines(rank_log: str):
    return [ln for ln in rank_log.splitlines() if ln.startswith("[paddle-fullparam] ")]


def _summary(proc) -> list:
    lines = proc.stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("paddle-fullparam run: COMMAND ended"))
    return lines[start:]


def _final_logits(model_dir: Path, lora_dir: Path = None):
    from paddleformers.transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="float32")
    if lora_dir is not None:
        from paddleformers.peft import LoRAModel

        model = LoRAModel.from_pretrained(model, str(lora_dir))
    ids = np.random.default_rng(3).integers(3, 512, (2, 16))
    return ids, paddle_logits(model, ids)


def test_full_sft_through_run(tmp_path, tiny_llama, hf_python):
    proc, rank_log, out = _cli(tmp_path, tiny_llama, ["--recipe", "hf_every_n_steps", "trigger.every_n_steps=2",
                                                      "export.dtype=keep"], [])
    snaps = sorted((out / "fullparam").glob("hf-step-*"))
    assert [s.name for s in snaps] == ["hf-step-000002", "hf-step-000004"], proc.stderr[-2000:]
    assert (out / "fullparam" / "latest").read_text().strip() == "hf-step-000004"
    for s in snaps:
        assert verify_snapshot(s).ok
        assert json.loads((s / "fullparam_manifest.json").read_text())["step"] == int(s.name[-6:])
        assert (s / "tokenizer.json").is_file()
    t2, t4 = (snapshot_tensors(s) for s in snaps)
    assert set(t2) == set(t4) and any(t2[k].tobytes() != t4[k].tobytes() for k in t2)  # it trained in between
    # one callback in the rank, said once; the CLI's parent imported the trainer module but built no Trainer
    assert _hook_lines(rank_log) == [
        "[paddle-fullparam] SFTTrainer: FullParamExportCallback attached (recipe hf_every_n_steps, overrides "
        f"trigger.every_n_steps=2 export.dtype=keep); snapshots in {out / 'fullparam'}"]
    assert _summary(proc) == [
        "paddle-fullparam run: COMMAND ended (exit status 0); 1 Trainer(s) built:",
        f"  paddleformers.cli.train.sft.sft_trainer.SFTTrainer (paddleformers 1.2.0, rank 0): FullParamExportCallback "
        f"attached; snapshots in {out / 'fullparam'} (2 committed)"]
    # as people use them: transformers with the snapshot's own tokenizer, and the trained model's function
    used = use_snapshots(hf_python, *snaps)
    for s in snaps:
        tf = used[str(s)]["transformers"]
        assert tf["vocab"] == 512 and tf["prompt_ids"][0] == 1 and len(tf["generated_ids"]) == 8, tf
        assert tf["missing_keys"] == tf["unexpected_keys"] == tf["mismatched_keys"] == [], tf
    ids, logits = _final_logits(out)
    report = run_hf_client(hf_python, snaps[-1], ids, logits, tmp_path)
    assert report["max_abs_diff"] <= 1e-4, report


def test_lora_sft_from_environment_variables(tmp_path, tiny_llama, hf_python):
    snaps_dir = tmp_path / "snaps"
    proc, rank_log, out = _cli(tmp_path, tiny_llama, ["--output-dir", "snaps"], ["fine_tuning=LoRA"], env_extra={
        "PADDLE_FULLPARAM_RECIPE": "hf_every_n_steps",
        "PADDLE_FULLPARAM_OVERRIDES": "trigger.every_n_steps=2 export.dtype=keep"})
    assert (out / "lora_config.json").is_file()  # it was a LoRA run
    snaps = sorted(snaps_dir.glob("hf-step-*"))
    assert [s.name for s in snaps] == ["hf-step-000002", "hf-step-000004"] and not (out / "fullparam").exists()
    assert all(verify_snapshot(s).ok for s in snaps)
    assert not any("lora" in k for k in snapshot_tensors(snaps[-1]))  # merged: the plain model's names
    assert len(_hook_lines(rank_log)) == 1 and f"snapshots in {snaps_dir}" in _hook_lines(rank_log)[0]
    used = use_snapshots(hf_python, snaps[-1])[str(snaps[-1])]["transformers"]
    assert used["missing_keys"] == used["unexpected_keys"] == [] and len(used["generated_ids"]) == 8, used
    ids, logits = _final_logits(tiny_llama, lora_dir=out)
    report = run_hf_client(hf_python, snaps[-1], ids, logits, tmp_path)
    assert report["max_abs_diff"] <= 1e-4, report


def test_pretraining_with_the_checkpoint_hook(tmp_path, tiny_llama, hf_python):
    proc, rank_log, out = _cli(tmp_path, tiny_llama, ["--recipe", "checkpoint_hook"],
                               ["stage=PT", f"train_dataset_path={DATA / 'pretrain.jsonl'}",
                                f"eval_dataset_path={DATA / 'pretrain.jsonl'}"])
    inside = [out / f"checkpoint-{n}" / "hf" for n in (2, 4)]
    assert all(verify_snapshot(s).ok for s in inside), sorted(p.name for p in out.iterdir())
    assert [json.loads((s / "fullparam_manifest.json").read_text())["step"] for s in inside] == [2, 4]
    assert not (out / "fullparam").exists()
    assert re.fullmatch(r"\[paddle-fullparam\] SFTTrainer: FullParamExportCallback attached \(recipe checkpoint_hook\); "
                        rf"snapshots in {re.escape(str(out))}/checkpoint-N/hf", _hook_lines(rank_log)[0])
    assert len(_hook_lines(rank_log)) == 1
    assert _summary(proc)[1].endswith(f"FullParamExportCallback attached; snapshots in {out}/checkpoint-N/hf")
    used = use_snapshots(hf_python, *inside)
    assert all(used[str(s)]["transformers"]["missing_keys"] == [] for s in inside), used


def test_what_only_a_rank_knows_fails_at_train_begin(tmp_path):
    """The variables alone (no run): the default output directory under the trainer's ``output_dir`` cannot
    be made there (a file has its name); the wrapper's callback refuses at on_train_begin, before step 1."""
    code = (
        "import json, os, sys\n"
        "from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args\n"
        "out = sys.argv[1]\n"
        "os.makedirs(out)\n"
        "open(os.path.join(out, 'fullparam'), 'w').write('not a directory')\n"
        "t = make_trainer('paddleformers', make_tiny_llama(), trainer_args('paddleformers', out, 4), [])\n"
        "try:\n"
        "    t.train()\n"
        "except Exception as e:\n"
        "    print('RESULT', json.dumps({'error': f'{type(e).__name__}: {e}', 'step': t.state.global_step}))\n"
    )
    sitedir = ROOT / "paddle_fullparam_callbacks" / "trainer" / "autoattach" / "sitedir"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_")}
    env.update(PYTHONPATH=f"{sitedir}{os.pathsep}{ROOT}", PADDLE_FULLPARAM_RECIPE="default")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    got = json.loads(line[7:])
    assert got["step"] == 0, got  # before step 1
    assert f"{tmp_path / 'out' / 'fullparam'}" in got["error"] and "not a directory" in got["error"], got
    assert "[paddle-fullparam] Trainer: FullParamExportCallback attached (recipe default); snapshots in " in proc.stderr
