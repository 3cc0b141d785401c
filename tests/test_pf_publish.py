"""The publisher with the real PaddleFormers Trainer (single process) and a real S3 protocol server (moto's
ThreadedMotoServer behind the tests' proxy): every committed snapshot copied while training goes on,
retention on both sides, the newest and best winning when publishing falls behind, a failed publication
that never stops training, the end of training's bound, the start's probe, ``publish.command``, and a job
(and its publisher) killed mid-multipart then resumed by the next start or ``paddle-fullparam publish``."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from paddle_fullparam_callbacks import FullParamExportCallback, attach, verify_snapshot
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args
from paddle_fullparam_callbacks.consumers.publish import records
from paddle_fullparam_callbacks.trainer.publishing import PublishStartFailed

from _evaluators import wait_until
from _helpers import AtStep, listing, run_cli
from _s3 import keys_under, moto, open_uploads, s3  # noqa: F401 (moto, s3: fixtures)

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]
# embeddings and head of 6000 x 256 floats: a 13 MB shard, three parts of 5 MiB
BIG = {"vocab_size": 6000, "hidden_size": 256, "intermediate_size": 256}
SHARD = "model.safetensors"


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


def publish_overrides(endpoint: str, bucket: str, *more: str) -> list:
    return [f"publish.url=s3://{bucket}/run", f"publish.endpoint_url={endpoint}", "publish.part_size=5MiB",
            "publish.max_memory=15MiB", "publish.concurrency=2", "publish.retry_backoff_s=0.01", *more]


def train(tmp_path, overrides, steps, at=None, model=None):
    cb = FullParamExportCallback(None, overrides=[f"output_dir={tmp_path / 'snaps'}", *overrides])
    targs = trainer_args("paddleformers", str(tmp_path / "trainer"), steps, save_steps=1000)
    trainer = make_trainer("paddleformers", model or make_tiny_llama(seed=0, **BIG), targs, [])
    attach(trainer, cb)
    if at:
        trainer.add_callback(AtStep({step: (lambda fn=fn: fn(tmp_path / "snaps")) for step, fn in at.items()}))
    trainer.train()
    return cb, trainer


def same_bytes(c, bucket: str, snap: Path) -> bool:
    """Every file of the snapshot (the manifest's, and the manifest) is on the store with the same bytes; the
    records and logs beside them (evaluation, publication) stay local."""
    names = [*json.loads((snap / "fullparam_manifest.json").read_text())["files"], "fullparam_manifest.json"]
    return all(c.get_object(Bucket=bucket, Key=f"run/{snap.name}/{n}")["Body"].read() == (snap / n).read_bytes()
               for n in names)


def shard_part(n: int):
    return lambda m, p: m == "PUT" and f"/{SHARD}?" in p and f"partNumber={n}" in p


def test_snapshots_are_published_while_training_the_newest_win_and_retention_runs_on_both_sides(s3, tmp_path, caplog):
    c, bucket, proxy = s3
    held = proxy.hold(shard_part(1))  # step 3's publication stays running while 6 and 9 are committed
    seen = {}

    def at_9(out):
        seen["listing"] = listing(out)
        seen["records"] = {s: (records.read(out / name(s), f"s3://{bucket}/run") or {}).get("status") for s in (3, 6, 9)}
        proxy.release()

    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    cb, _ = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket, "publish.keep_last=2"), "trigger.every_n_steps=3",
                             "retention.keep_last=1", "trigger.on_train_end=false"], 9, at={9: at_9})
    assert held.arrived.is_set()
    # while 3 was being published and 6 waited, local retention (keep_last=1) kept both
    assert seen["listing"] == [name(3), name(6), name(9), "latest"] and seen["records"][3] == "running"
    assert [(p.name, p.status) for p in cb.publishing.results] == [(name(3), "ok"), (name(6), "skipped"), (name(9), "ok")]
    snaps = tmp_path / "snaps"
    assert listing(snaps) == [name(9), "latest"]  # once published (or skipped), retention removed them
    assert records.read(snaps / name(9), f"s3://{bucket}/run")["status"] == "ok" and same_bytes(c, bucket, snaps / name(9))
    assert sorted({k.split("/")[1] for k in keys_under(c, bucket)}) == [name(3), name(9), "latest"]
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == f"{name(9)}\n".encode()
    assert open_uploads(c, bucket) == [] and verify_snapshot(snaps / name(9)).ok
    skipped = [r for r in caplog.records if "skipped" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(skipped) == 1 and name(6) in skipped[0].getMessage()
    # the publishing process ran at lower priority, its output in the snapshot's log
    assert "hf-step-000009" in (snaps / name(9) / records.LOG).read_text() or (snaps / name(9) / records.LOG).exists()


def test_a_failed_publication_is_recorded_and_logged_once_training_goes_on_and_publish_finishes_it(s3, moto, tmp_path, caplog):
    c, bucket, proxy = s3
    proxy.fail(lambda m, p: m == "PUT" and "/hf-step-" in p, 500, "InternalError", times=10**6)
    caplog.set_level(logging.INFO, logger="paddle_fullparam_callbacks")
    cb, trainer = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket, "publish.retries=1"),
                                   "trigger.every_n_steps=2"], 4, model=make_tiny_llama(seed=0))
    assert trainer.state.global_step == 4 and cb.errors == []
    assert [(p.name, p.status) for p in cb.publishing.results] == [(name(2), "failed"), (name(4), "failed")]
    entry = records.read(tmp_path / "snaps" / name(4), f"s3://{bucket}/run")
    assert entry["status"] == "failed" and "InternalError (HTTP 500)" in entry["error"] and "after 2 attempts" in entry["error"]
    failed = [r for r in caplog.records if "publication of" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(failed) == 2
    assert not any(k.endswith("fullparam_manifest.json") for k in keys_under(c, bucket))
    proxy.clear()
    res = run_cli("publish", str(tmp_path / "snaps"), "--to", f"s3://{bucket}/run", f"publish.endpoint_url={moto}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines() if line.startswith("hf-step")] == [name(2), name(4)]
    for step in (2, 4):
        assert records.read(tmp_path / "snaps" / name(step), f"s3://{bucket}/run")["status"] == "ok"
        assert same_bytes(c, bucket, tmp_path / "snaps" / name(step))
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == f"{name(4)}\n".encode()


def test_the_end_waits_a_bound_records_unfinished_and_the_next_start_finishes_it(s3, tmp_path):
    c, bucket, proxy = s3
    held = proxy.hold(shard_part(3))
    # the last step waits until the publication is mid-multipart, then the end gives it no time
    cb, _ = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket, "publish.wait_at_end_s=0", "publish.concurrency=1"),
                             "trigger.every_n_steps=1", "trigger.on_train_end=false"], 1,
                  at={1: lambda out: held.arrived.wait(120)})
    assert held.arrived.is_set()
    snap = tmp_path / "snaps" / name(1)
    entry = records.read(snap, f"s3://{bucket}/run")
    assert entry["status"] == "unfinished" and "publish.wait_at_end_s" in entry["error"]
    assert len(open_uploads(c, bucket)) == 1 and f"run/{name(1)}/fullparam_manifest.json" not in keys_under(c, bucket)
    proxy.release()
    # an upload under a snapshot no publication will resume (its snapshot removed locally): aborted at the start
    c.create_multipart_upload(Bucket=bucket, Key=f"run/{name(77)}/{SHARD}")
    # the next start (a new job into the same directory) finishes it, resuming the multipart upload
    cb2, _ = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket), "trigger.every_n_steps=100",
                              "trigger.on_train_end=false"], 1, model=make_tiny_llama(seed=0))
    done = [p for p in cb2.publishing.results if p.name == name(1)]
    assert len(done) == 1 and done[0].status == "ok" and done[0].entry["result"]["reused_parts"] >= 1
    assert open_uploads(c, bucket) == [] and same_bytes(c, bucket, snap)
    assert not (snap / records.WORKDIR).exists()


def test_the_start_fails_before_step_one_when_the_store_cannot_be_used(moto, tmp_path):
    with pytest.raises(PublishStartFailed, match=r"publish.url s3://missing-bucket/run \(endpoint http://127.0.0.1:\d+\): "
                                                 r"cannot write the probe object .*NoSuchBucket"):
        train(tmp_path, [f"publish.url=s3://missing-bucket/run", f"publish.endpoint_url={moto}"], 2,
              model=make_tiny_llama(seed=0))
    assert not (tmp_path / "snaps").exists()


def test_with_the_evaluation_hook_best_on_the_store_follows_the_scores_that_come_after_publishing(s3, tmp_path):
    from _evaluators import fake_evaluator, python_override, stop_leftovers

    c, bucket, proxy = s3
    command = fake_evaluator(tmp_path, {"scores": {"2": 1.0, "4": 5.0, "6": 3.0}})
    try:
        cb, _ = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket, "publish.keep_last=1"), python_override(),
                                 f"evaluate.command={command}", "trigger.every_n_steps=2", "trigger.on_train_end=false",
                                 "retention.metric=evaluate.score", "retention.keep_last=1", "retention.keep_best=1"], 6,
                      model=make_tiny_llama(seed=0))
    finally:
        stop_leftovers(tmp_path)
    assert [(ev.step, ev.status) for ev in cb.evaluation.results] == [(2, "ok"), (4, "ok"), (6, "ok")]
    assert {p.name: p.status for p in cb.publishing.results if p.status == "ok"}.keys() >= {name(6)}
    snaps = tmp_path / "snaps"
    assert (snaps / "best").read_text().strip() == name(2) and listing(snaps) == ["best", name(2), name(6), "latest"]
    # the store's best follows the local one, and remote retention (keep_last=1) keeps it beside latest
    assert c.get_object(Bucket=bucket, Key="run/best")["Body"].read() == f"{name(2)}\n".encode()
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == f"{name(6)}\n".encode()
    assert sorted({k.split("/")[1] for k in keys_under(c, bucket)}) == ["best", name(2), name(6), "latest"]
    assert same_bytes(c, bucket, snaps / name(2)) and open_uploads(c, bucket) == []


COPY = r'''
import json, os, shutil, sys
snapshot, name, step, output, dest = sys.argv[1:6]
shutil.copytree(snapshot, os.path.join(dest, name), ignore=shutil.ignore_patterns(".fullparam-*", "fullparam_publish*"))
json.dump({"copied": name, "step": int(step), "nice": os.nice(0)}, open(output, "w"))
'''


def test_publish_command_runs_per_snapshot_through_the_same_runner(tmp_path):
    script, dest = tmp_path / "copy.py", tmp_path / "elsewhere"
    script.write_text(COPY)
    dest.mkdir()
    cb, _ = train(tmp_path, [f"publish.command={{python}} {script} {{snapshot}} {{name}} {{step}} {{output}} {dest}",
                             "trigger.every_n_steps=2"], 4, model=make_tiny_llama(seed=0))
    assert [(p.name, p.status, p.entry["result"]) for p in cb.publishing.results] == [
        (name(s), "ok", {"copied": name(s), "step": s, "nice": 10}) for s in (2, 4)]
    assert sorted(os.listdir(dest)) == [name(2), name(4)] and verify_snapshot(dest / name(4)).ok
    assert records.read(tmp_path / "snaps" / name(4), "command")["command"].startswith("{python}")


KILLED_JOB = r"""
import sys
from paddle_fullparam_callbacks import FullParamExportCallback, attach
from paddle_fullparam_callbacks.cli.demo import make_tiny_llama, make_trainer, trainer_args
out, overrides = sys.argv[1], sys.argv[2:]
cb = FullParamExportCallback(None, overrides=[f"output_dir={out}/snaps", "trigger.every_n_steps=2", *overrides])
trainer = make_trainer("paddleformers", make_tiny_llama(seed=0, vocab_size=6000, hidden_size=256, intermediate_size=256),
                       trainer_args("paddleformers", f"{out}/trainer", 400, save_steps=1000), [])
attach(trainer, cb)
trainer.train()
"""


def _stored_parts(c, bucket: str) -> int:
    return sum(len(c.list_parts(Bucket=bucket, Key=key, UploadId=uid).get("Parts", [])) for key, uid in open_uploads(c, bucket))


@pytest.mark.parametrize("publisher_killed", [False, True], ids=["job", "job-and-publisher"])
def test_a_job_killed_mid_multipart_is_finished_by_the_next_start(s3, tmp_path, publisher_killed):
    c, bucket, proxy = s3
    held = proxy.hold(shard_part(2))
    env = {**os.environ, "PFC_FAULT_POINT": "publish_running"}  # SIGKILL once the first publication runs
    proc = subprocess.run([sys.executable, "-c", KILLED_JOB, str(tmp_path), *publish_overrides(proxy.endpoint, bucket)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    snap = tmp_path / "snaps" / name(2)
    running = records.read(snap, f"s3://{bucket}/run")
    assert running["status"] == "running" and held.arrived.wait(120)  # mid-multipart, the job gone
    runner = psutil.Process(running["pid"])  # the runner outlived the job (a session of its own)
    if publisher_killed:
        # part 1 goes out beside the held part 2 (parallel parts): killed before the store has it, nothing
        # would be left to reuse (seen: 1 run in 10)
        wait_until(lambda: _stored_parts(c, bucket) >= 1, "part 1 of the held upload to be stored", timeout_s=60)
        worker = json.loads((snap / records.WORKDIR / "evaluator.pid").read_text())["pid"]
        os.killpg(worker, signal.SIGKILL)
        runner.kill()
        proxy.release()
        runner.wait(60)
        assert len(open_uploads(c, bucket)) == 1
    else:
        proxy.release()
        runner.wait(120)  # it finishes the publication alone
    cb, _ = train(tmp_path, [*publish_overrides(proxy.endpoint, bucket), "trigger.every_n_steps=100",
                             "trigger.on_train_end=false"], 1, model=make_tiny_llama(seed=0))
    entry = records.read(snap, f"s3://{bucket}/run")
    assert entry["status"] == "ok" and open_uploads(c, bucket) == [] and same_bytes(c, bucket, snap)
    assert entry["result"]["reused_parts"] >= 1 if publisher_killed else entry["pid"] == running["pid"]
    # settled at the start (the runner dead: unfinished), then published again; or recorded as the runner left it
    expected = [(name(2), True, "unfinished"), (name(2), True, "ok")] if publisher_killed else [(name(2), True, "ok")]
    assert [(p.name, p.recovered, p.status) for p in cb.publishing.results] == expected
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == f"{name(2)}\n".encode()
