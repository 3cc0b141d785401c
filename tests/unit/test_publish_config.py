"""The publish section (issue 26): every rule has one message naming the key; the pure pieces of the
publisher (the S3 URL, the part size, the journal, the record, the final entry) without a store."""
from __future__ import annotations

import json
import time

import pytest

from paddle_fullparam_callbacks.config.publishing import parse_s3_url
from paddle_fullparam_callbacks.config.recipes import load_config
from paddle_fullparam_callbacks.config.schema import ConfigError
from paddle_fullparam_callbacks.consumers.publish import records
from paddle_fullparam_callbacks.consumers.publish.journal import Journal
from paddle_fullparam_callbacks.consumers.publish.result import final_entry
from paddle_fullparam_callbacks.consumers.publish.upload import part_size_for


def test_a_publish_section_loads_and_the_url_is_normalised():
    cfg = load_config(None, ["publish.url=s3://my-bucket/runs/llama/", "publish.part_size=8MiB", "publish.max_memory=64MiB"])
    assert cfg.publish.url == "s3://my-bucket/runs/llama" and cfg.publish.enabled
    assert not load_config(None, []).publish.enabled
    assert load_config(None, ["publish.url=s3://my-bucket"]).publish.url == "s3://my-bucket"


@pytest.mark.parametrize("overrides, key, message", [
    (["publish.url=my-bucket/x"], "publish.url", "must be s3://bucket/prefix"),
    (["publish.url=s3://My_Bucket/x"], "publish.url", "'My_Bucket' is not a valid bucket name"),
    (["publish.url=s3://bkt/a//b"], "publish.url", "empty, '.' or '..' component"),
    (["publish.url=s3://bkt/a/../b"], "publish.url", "empty, '.' or '..' component"),
    (["publish.url=s3://bkt/x", "publish.command=echo {snapshot}"], "publish.command", "give one of them"),
    (["publish.command=echo {nope}"], "publish.command", r"unknown field \{nope\}; the command may use \{snapshot\}"),
    (["publish.command=echo 'open"], "publish.command", "does not split into words"),
    (["publish.command=echo {snapshot}", "publish.keep_last=2"], "publish.keep_last", "applies to publish.url"),
    (["publish.url=s3://bkt/x", "publish.endpoint_url=localhost:9000"], "publish.endpoint_url", r"http\(s\)://host"),
    (["publish.url=s3://bkt/x", "publish.part_size=1MB"], "publish.part_size", "between 5MiB and 5GiB"),
    (["publish.url=s3://bkt/x", "publish.part_size=6GB"], "publish.part_size", "between 5MiB and 5GiB"),
    (["publish.url=s3://bkt/x", "publish.part_size=lots"], "publish.part_size", ""),
    (["publish.url=s3://bkt/x", "publish.max_memory=100MB"], "publish.max_memory", "fewer than two parts"),
    (["publish.url=s3://bkt/x", "publish.concurrency=0"], "publish.concurrency", "whole number >= 1"),
    (["publish.url=s3://bkt/x", "publish.retries=-1"], "publish.retries", "whole number >= 0"),
    (["publish.url=s3://bkt/x", "publish.timeout_s=0"], "publish.timeout_s", "> 0"),
    (["publish.url=s3://bkt/x", "publish.nice=20"], "publish.nice", "<= 19"),
    (["publish.url=s3://bkt/x", "publish.keep_best=1"], "publish.keep_best", "needs retention.metric"),
    (["publish.url=s3://bkt/x", "export.format=callable", "export.callable=m:f"], "publish.url", "writes no snapshot"),
])
def test_each_rule_names_its_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert e.value.key == key


def test_the_s3_url_and_the_part_size():
    assert parse_s3_url("s3://a.b-c/x/y/") == ("a.b-c", "x/y")
    with pytest.raises(ValueError, match="brace"):
        parse_s3_url("s3://bkt/{step}")
    mib = 2**20
    assert part_size_for(100 * mib, 64 * mib) == 64 * mib
    assert part_size_for(5 * 2**40, 64 * mib) == 525 * mib  # 5 TiB in at most 10,000 parts
    assert -(-5 * 2**40 // part_size_for(5 * 2**40, 5 * mib)) <= 10_000


def test_the_journal_keeps_open_uploads_and_survives_a_torn_line(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.started("s3://b/p", "p/a", "u1", 5, 10, "d")
    j.started("s3://b/p", "p/b", "u2", 5, 10, "d")
    j.started("s3://other/p", "p/c", "u3", 5, 10, "d")
    j.done("s3://b/p", "p/a", "u1")
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"event": "upload", "upload_id": "u4"')  # a crash cut this line short
    assert list(j.open_uploads("s3://b/p")) == ["u2"] and sorted(j.open_uploads()) == ["u2", "u3"]
    j.clear()
    assert j.open_uploads() == {}


def test_the_record_keeps_one_entry_per_destination(tmp_path):
    records.write(tmp_path, "s3://b/p", {"status": "ok"})
    records.write(tmp_path, "command", {"status": "failed"})
    records.write(tmp_path, "s3://b/p", {"status": "skipped"})
    assert records.read_all(tmp_path) == {"s3://b/p": {"status": "skipped"}, "command": {"status": "failed"}}
    (tmp_path / records.RECORD).write_text("[1]")
    assert records.read(tmp_path, "s3://b/p") is None


@pytest.mark.parametrize("status, output, expected, error", [
    (None, None, "unfinished", "ended without a result"),
    ({"exit_code": 0}, {"url": "s3://b/p/x/"}, "ok", None),
    ({"exit_code": -15, "terminated": True}, None, "unfinished", "the training ended before it finished"),
    ({"exit_code": -9, "timed_out": True}, None, "failed", "publish.timeout_s=60"),
    ({"exit_code": 1, "last_line": json.dumps({"error": "StoreError: NoSuchBucket"})}, None, "failed", "NoSuchBucket"),
    ({"exit_code": 2}, None, "failed", "exit status 2"),
])
def test_the_final_entry_from_what_the_runner_saw(tmp_path, status, output, expected, error):
    if status is not None:
        (tmp_path / "status.json").write_text(json.dumps(status))
    if output is not None:
        (tmp_path / "output.json").write_text(json.dumps(output))
    entry = final_entry({"status": "running", "snapshot": "s", "timeout_s": 60}, tmp_path / "status.json",
                        tmp_path / "output.json", tmp_path / "log", 5.0)
    assert entry["status"] == expected and entry["snapshot"] == "s"
    assert (error is None and entry.get("result") == output) or error in entry["error"]


class _Ctx:
    """A rank's view of the job for the start's one exchange: what the coordinator said is what every rank gets."""

    def __init__(self, coordinator_says, is_coordinator=False):
        self.is_coordinator, self.coordinator, self.said = is_coordinator, 0, coordinator_says
        self.exchanges = []

    def all_gather_object(self, obj, what=""):
        self.exchanges.append((what, obj))
        return [self.said if not self.is_coordinator else obj, obj]


def test_every_rank_stops_alike_when_the_coordinators_probe_fails():
    from paddle_fullparam_callbacks.trainer.publishing import PublishStartFailed, TrainerPublishing

    cfg = load_config(None, ["publish.url=s3://bkt/run"])
    other = _Ctx("publish.url s3://bkt/run (endpoint http://x): cannot write the probe object ...: NoSuchBucket")
    with pytest.raises(PublishStartFailed, match="NoSuchBucket"):
        TrainerPublishing(cfg).check(other)  # a rank that probes nothing, told by the coordinator
    assert other.exchanges == [("publish probe", None)]
    fine = _Ctx(None)
    TrainerPublishing(cfg).check(fine)
    assert fine.exchanges == [("publish probe", None)]
    off = _Ctx("never asked")
    TrainerPublishing(load_config(None, [])).check(off)  # publishing off: no exchange at all
    assert off.exchanges == []


def test_paddle_fullparam_publish_refuses_bad_input_before_anything_is_written(tmp_path, capsys):
    from paddle_fullparam_callbacks.cli.main import main

    (tmp_path / "empty").mkdir()
    assert main(["publish", str(tmp_path / "empty")]) == 2
    assert "publish.url: is not set (nor publish.command): give --to s3://bucket/prefix" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "empty"), "--to", "s3://Bad_Bucket/x"]) == 2
    assert "publish.url: 'Bad_Bucket' is not a valid bucket name" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "nowhere"), "--to", "s3://bkt/x"]) == 2
    assert "holds no snapshot named like export.name_template" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_a_runner_started_but_never_recorded_is_found_and_adopted(tmp_path):
    """A job killed between starting its publisher's runner and writing the running record: the next start
    finds the runner by its command line and adopts it instead of starting a second publisher."""
    import subprocess
    import sys

    import psutil

    from paddle_fullparam_callbacks.export.commit.ownership import mark
    from paddle_fullparam_callbacks.consumers.hook import RUNNER
    from paddle_fullparam_callbacks.consumers.publish.recovery import recover
    from paddle_fullparam_callbacks.consumers.runner import is_alive

    snap = tmp_path / "hf-step-000003"
    work = snap / records.WORKDIR
    work.mkdir(parents=True)
    (snap / "fullparam_manifest.json").write_text(json.dumps({"step": 3, "files": {}}))
    mark(work, "r1")
    gate = tmp_path / "gate"
    wait = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)"
    (work / "spec.json").write_text(json.dumps({"argv": [sys.executable, "-c", wait], "timeout_s": 60, "nice": 0,
                                                "log": str(snap / records.LOG)}))
    runner = subprocess.Popen([sys.executable, "-I", str(RUNNER), str(work)], start_new_session=True)
    try:
        # Popen returns once exec() is under way, when /proc/<pid>/cmdline can still read empty for a moment
        # (seen 1 time in 5): a runner found at a job's next start has been running for a long while
        deadline = time.monotonic() + 30
        while not is_alive(runner.pid, str(work)) and time.monotonic() < deadline:
            time.sleep(0.001)
        out = recover(None, [(snap.name, 3, snap, "r1")], "s3://bkt/run", "r1")
        assert [(p.name, p.adopted, p.running["pid"]) for p in out["adopted"]] == [(snap.name, True, runner.pid)]
        assert out["todo"] == [] and out["settled"] == []
    finally:
        gate.write_text("go")
        psutil.Process(runner.pid).wait(30)
    # once it has ended, nothing runs there: the resumed run publishes the snapshot (idempotent on the store)
    out = recover(None, [(snap.name, 3, snap, "r1")], "s3://bkt/run", "r1")
    assert [p.name for p in out["todo"]] == [snap.name] and out["adopted"] == []
