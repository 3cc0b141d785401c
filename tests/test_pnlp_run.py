"""``paddle-fullparam run`` around a script shaped like PaddleNLP's ``llm/run_finetune.py``
(``tests/run/pnlp_finetune.py``: JSON arguments through ``PdArgumentParser``, its own Trainer subclass
adding a callback after ``super().__init__``, its own callbacks list), with PaddleNLP 2.8 on CPU:

* 2 ranks under ``python -m paddle.distributed.launch`` (pure data parallel): both ranks' Trainers get
  exactly one FullParamExportCallback (the recipe from ``--recipe``, overrides from the flags and from
  ``PADDLE_FULLPARAM_OVERRIDES``), the snapshots of steps 2 and 4 are written once, load in transformers
  with the tokenizer files named by ``export.tokenizer``, and give the trained model's logits;
* 1 rank, without a launcher: the wrapper's callback (the package's defaults: a snapshot at each trainer
  save); then the script attaching its own FullParamExportCallback after building its Trainer: it keeps
  its own, the wrapper adds none and says so once, and ``run``'s summary says so.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks import verify_snapshot
from paddle_fullparam_callbacks.cli.demo import DEMO_TOKENIZER

from _helpers import run_hf_client, use_snapshots

pytestmark = [pytest.mark.paddlenlp, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run" / "pnlp_finetune.py"
RUN = [sys.executable, "-m", "paddle_fullparam_callbacks", "run"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("pnlp")
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_llama.py"), str(base / "model"), "--framework",
                    "paddlenlp"], check=True, capture_output=True, timeout=300)
    (base / "data").mkdir()
    shutil.copy(ROOT / "examples" / "paddleformers_cli" / "data" / "sft_train.jsonl", base / "data" / "train.json")
    return base


def _args(job: Path, tmp_path: Path, **extra) -> Path:
    args = {"model_name_or_path": str(job / "model"), "dataset_name_or_path": str(job / "data"),
            "output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 2,
            "learning_rate": 1e-3, "logging_steps": 1, "save_steps": 2, "report_to": "none", "device": "cpu",
            "disable_tqdm": True, "seed": 0, "sharding": "", "max_grad_norm": 0, "report": str(tmp_path / "report"),
            **extra}
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    return path


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_FULLPARAM_")}
    env.update(extra)
    return env


def _reports(tmp_path: Path, world: int) -> list:
    return [json.loads((tmp_path / f"report.{r}.json").read_text()) for r in range(world)]


def test_two_ranks_under_the_launcher(job, tmp_path, hf_python):
    args = _args(job, tmp_path)
    proc = subprocess.run([*RUN, "--recipe", "hf_every_n_steps", "trigger.every_n_steps=2", "--", sys.executable, "-m",
                           "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
                           str(SCRIPT), str(args)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=_env(PFC_TEST_GLOO_SAFE="1",
                                   PADDLE_FULLPARAM_OVERRIDES=f"export.dtype=keep export.tokenizer={DEMO_TOKENIZER}"))
    logs = {r: (tmp_path / "log" / f"workerlog.{r}").read_text(errors="replace") for r in (0, 1)}
    assert proc.returncode == 0, proc.stderr[-3000:] + logs[0][-4000:] + logs[1][-4000:]
    snaps_dir = tmp_path / "out" / "fullparam"
    for rep in _reports(tmp_path, 2):
        assert rep["world"] == 2 and rep["steps"] == 4, rep
        assert rep["callbacks"].count("FullParamExportCallback") == 1 and "LossWatch" in rep["callbacks"], rep
        (cb,) = rep["fullparam"]
        assert cb["module"] == "paddle_fullparam_callbacks.trainer.callback" and not cb["own"], cb
        assert cb["events"] == ["every_n_steps@2", "every_n_steps@4"], cb
    for r in (0, 1):
        hook = [ln for ln in logs[r].splitlines() if ln.startswith("[paddle-fullparam] ")]
        assert hook == ["[paddle-fullparam] CausalLMTrainer: FullParamExportCallback attached (recipe hf_every_n_steps, "
                        f"overrides export.dtype=keep export.tokenizer={DEMO_TOKENIZER} trigger.every_n_steps=2); "
                        f"snapshots in {snaps_dir}"], hook
    assert f"__main__.CausalLMTrainer (paddlenlp 2.8.1, ranks 0, 1): FullParamExportCallback attached; snapshots in " \
           f"{snaps_dir} (2 committed)" in proc.stderr, proc.stderr[-2000:]
    snaps = sorted(snaps_dir.glob("hf-step-*"))
    assert [s.name for s in snaps] == ["hf-step-000002", "hf-step-000004"]
    assert all(verify_snapshot(s).ok for s in snaps)
    used = use_snapshots(hf_python, *snaps)
    for s in snaps:
        tf = used[str(s)]["transformers"]
        assert tf["vocab"] == 512 and tf["missing_keys"] == tf["unexpected_keys"] == [] and len(tf["generated_ids"]) == 8
    ids, logits = np.load(tmp_path / "report.0.ids.npy"), np.load(tmp_path / "report.0.logits.npy")
    assert np.array_equal(logits, np.load(tmp_path / "report.1.logits.npy"))  # data parallel: one model
    report = run_hf_client(hf_python, snaps[-1], ids, logits, tmp_path)
    assert report["max_abs_diff"] <= 1e-4, report


def test_one_rank_without_and_with_its_own_callback(job, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    proc = subprocess.run([*RUN, "--", sys.executable, str(SCRIPT), str(_args(job, plain))],
                          cwd=plain, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rep,) = _reports(plain, 1)
    assert rep["world"] == 1 and rep["callbacks"].count("FullParamExportCallback") == 1, rep
    assert rep["fullparam"][0]["events"] == ["save@2", "save@4"] and not rep["fullparam"][0]["own"], rep
    assert sorted(p.name for p in (plain / "out" / "fullparam").glob("hf-step-*")) == ["hf-step-000002", "hf-step-000004"]
    assert "FullParamExportCallback attached (recipe default); snapshots in " in proc.stderr

    own = tmp_path / "own_snaps"
    args = _args(job, tmp_path, own_callback_dir=str(own))
    proc = subprocess.run([*RUN, "--recipe", "hf_every_n_steps", "--", sys.executable, str(SCRIPT), str(args)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rep,) = _reports(tmp_path, 1)
    assert rep["callbacks"].count("FullParamExportCallback") == 1 and rep["fullparam"][0]["own"], rep
    assert rep["fullparam"][0]["events"] == ["every_n_steps@2", "every_n_steps@4"]
    assert sorted(p.name for p in own.glob("hf-step-*")) == ["hf-step-000002", "hf-step-000004"]
    assert not (tmp_path / "out" / "fullparam").exists()  # the wrapper's default directory: nothing
    hook = [ln for ln in proc.stderr.splitlines() if ln.startswith("[paddle-fullparam] ")]
    assert hook == ["[paddle-fullparam] CausalLMTrainer already has a FullParamExportCallback: it keeps its own; "
                    "PADDLE_FULLPARAM_RECIPE adds none"], hook
    assert "  __main__.CausalLMTrainer (paddlenlp 2.8.1, rank 0): had its own FullParamExportCallback, kept it (the " \
           "wrapper added none)" in proc.stderr
