"""The publisher's engine against a real S3 protocol server (moto's ThreadedMotoServer on a free port, real
HTTP and boto3; a proxy in front of it misbehaves on request): the order of requests that commits a
snapshot on the store, remote retention and pointers, resuming after the publishing process is killed
mid-multipart, throttling and 5xx, the start's probe (access denied, bad credentials, a missing bucket, a
wrong endpoint, a store ignoring conditional headers), and ``paddle-fullparam verify s3://``."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from paddle_fullparam_callbacks.config.schema import PublishConfig
from paddle_fullparam_callbacks.consumers.publish.engine import publish_one
from paddle_fullparam_callbacks.consumers.publish.probe import ProbeFailed, probe
from paddle_fullparam_callbacks.consumers.publish.remote import RemoteConflict
from paddle_fullparam_callbacks.consumers.publish.store import Store, StoreError
from paddle_fullparam_callbacks.consumers.publish.upload import LocalFileChanged
from paddle_fullparam_callbacks.export.write import checksum

from _s3 import enforce_auth, keys_under, moto, open_uploads, s3  # noqa: F401 (moto, s3: fixtures)

pytestmark = [pytest.mark.paddleformers]
MIB = 2**20


def make_snapshot(out: Path, step: int, run: str = "r1", shard: int = 11 * MIB + 3, seed: int = 0,
                  loss: Optional[float] = None) -> Path:
    """A committed snapshot as the package writes it: files, then a manifest with their BLAKE3."""
    d = out / f"hf-step-{step:06d}"
    d.mkdir(parents=True, exist_ok=True)
    rng = __import__("random").Random(step * 1000 + seed)
    files = {"model-00001-of-00002.safetensors": rng.randbytes(shard), "model-00002-of-00002.safetensors": rng.randbytes(1000),
             "config.json": b'{"model_type": "llama"}', "model.safetensors.index.json": b'{"weight_map": {}}'}
    for n, b in files.items():
        (d / n).write_bytes(b)
    manifest = {"manifest_version": 1, "snapshot": d.name, "step": step, "checksum": "blake3", "metrics": {"loss": 10.0 / step if loss is None else loss},
                "run": {"id": run, "seq": step}, "created_unix": time.time() + seed,
                "files": {n: {"bytes": len(b), "blake3": checksum.new("blake3", b).hexdigest()} for n, b in files.items()}}
    (d / "fullparam_manifest.json").write_text(json.dumps(manifest))
    return d


def config(endpoint: str, bucket: str, **kw) -> PublishConfig:
    return PublishConfig(**{"url": f"s3://{bucket}/run", "endpoint_url": endpoint, "part_size": "5MiB",
                            "max_memory": "15MiB", "concurrency": 2, "retry_backoff_s": 0.01, **kw})


def spec(snap: Path, cfg: PublishConfig, run: str = "r1", **kw) -> dict:
    work = snap / ".fullparam-publish"
    work.mkdir(exist_ok=True)
    step = json.loads((snap / "fullparam_manifest.json").read_text())["step"]
    return {"snapshot": str(snap), "name": snap.name, "step": step, "output_dir": str(snap.parent), "work": str(work),
            "publish": dataclasses.asdict(cfg), "name_template": "hf-step-{step:06d}", "run_id": run,
            "other_runs": "keep", "metric": None, "mode": "min", **kw}


def same_bytes(c, bucket: str, snap: Path, prefix: str = "run") -> bool:
    for p in snap.iterdir():
        if p.is_file() and not p.name.startswith("fullparam_publish"):
            got = c.get_object(Bucket=bucket, Key=f"{prefix}/{snap.name}/{p.name}")["Body"].read()
            if got != p.read_bytes():
                return False
    return True


def is_part(method, path):
    return method == "PUT" and "partNumber=" in path


def test_snapshots_go_out_manifest_last_with_retention_and_pointers(s3, tmp_path):
    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket, keep_last=2)
    snaps = [make_snapshot(tmp_path, step) for step in (1, 2, 3)]
    for snap in snaps:
        proxy.seen.clear()
        out = publish_one(spec(snap, cfg))
        assert out["files"] == 4 and out["parts"] == 3 and out["latest"] == snap.name and same_bytes(c, bucket, snap)
        # every file's request comes before the manifest's PUT, and nothing comes after it but pointers/retention
        order = [p for m, p in proxy.seen if m in ("PUT", "POST") and snap.name in p]
        assert order[-1].endswith(f"{snap.name}/fullparam_manifest.json")
        assert not open_uploads(c, bucket)
    assert keys_under(c, bucket) == sorted(
        [f"run/{s.name}/{n}" for s in snaps[1:] for n in ("config.json", "fullparam_manifest.json", "model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors", "model.safetensors.index.json")]
        + ["run/latest"])
    assert out["removed"] == [snaps[0].name]
    # remote retention deleted step 1's manifest before any of its files
    deletes = [(m, p) for m, p in proxy.seen if (m == "DELETE" and snaps[0].name in p) or (m == "POST" and "delete" in p)]
    assert deletes[0][0] == "DELETE" and deletes[0][1].endswith(f"{snaps[0].name}/fullparam_manifest.json")
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"hf-step-000003\n"


def test_a_reader_listing_during_the_upload_never_sees_a_manifest_before_all_files(s3, tmp_path):
    c, bucket, proxy = s3
    snap = make_snapshot(tmp_path, 7, shard=16 * MIB)
    held = proxy.hold(is_part)  # the first part is held (then dropped: the publisher retries it)
    seen, errors = [], []

    def publish():
        try:
            publish_one(spec(snap, config(proxy.endpoint, bucket)))
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=publish)
    t.start()
    assert held.arrived.wait(60)
    seen.append(keys_under(c, bucket))  # mid-multipart: no manifest
    proxy.release()
    while t.is_alive():
        seen.append(keys_under(c, bucket))
    t.join()
    seen.append(keys_under(c, bucket))
    assert errors == []
    expected = {f"run/{snap.name}/{p.name}": p.stat().st_size for p in snap.iterdir() if p.is_file()}
    for listing in seen:
        if f"run/{snap.name}/fullparam_manifest.json" in listing:
            assert set(expected) <= set(listing)
    assert f"run/{snap.name}/fullparam_manifest.json" not in seen[0] and set(expected) <= set(seen[-1])
    assert len(seen) >= 2 and same_bytes(c, bucket, snap) and not open_uploads(c, bucket)


WORKER = [sys.executable, "-m", "paddle_fullparam_callbacks.consumers.publish.worker"]


@pytest.mark.parametrize("journal_lost", [False, True], ids=["journal", "store-listing"])
def test_the_publisher_killed_mid_multipart_resumes_and_leaves_no_upload_behind(s3, tmp_path, journal_lost):
    c, bucket, proxy = s3
    snap = make_snapshot(tmp_path, 4, shard=21 * MIB)  # 5 parts of 5 MiB
    cfg = config(proxy.endpoint, bucket, concurrency=1, max_memory="10MiB")
    sp = spec(snap, cfg)
    (tmp_path / "spec.json").write_text(json.dumps(sp))
    held = proxy.hold(lambda m, p: is_part(m, p) and "partNumber=3" in p)
    proc = subprocess.Popen([*WORKER, str(tmp_path / "spec.json"), str(tmp_path / "out.json")], env={**os.environ})
    try:
        assert held.arrived.wait(120)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -9
    finally:
        proxy.release()
    assert len(open_uploads(c, bucket)) == 1 and f"run/{snap.name}/fullparam_manifest.json" not in keys_under(c, bucket)
    if journal_lost:  # a crash between the store's answer and the journal's write: the store's listing finds it
        (Path(sp["work"]) / "journal.jsonl").unlink()
    proxy.seen.clear()
    out = publish_one(sp)
    if journal_lost:
        assert out["aborted_uploads"] == 1 and out["reused_parts"] == 0 and proxy.count("PUT", "partNumber=") == 5
    else:
        assert out["aborted_uploads"] == 0 and out["reused_parts"] == 2 and proxy.count("PUT", "partNumber=") == 3
    assert open_uploads(c, bucket) == [] and same_bytes(c, bucket, snap)
    assert not (Path(sp["work"]) / "journal.jsonl").exists()


def test_throttling_and_server_errors_are_retried_and_a_lost_answer_is_recognised(s3, tmp_path):
    c, bucket, proxy = s3
    snap = make_snapshot(tmp_path, 5)
    proxy.fail(is_part, 503, "SlowDown", times=2)
    proxy.fail(lambda m, p: m == "PUT" and p.endswith("config.json"), 500, "InternalError")
    proxy.fail(lambda m, p: m == "HEAD", 503, "ServiceUnavailable")
    proxy.lose(lambda m, p: m == "POST" and "uploadId=" in p)  # Complete done, its answer lost
    proxy.lose(lambda m, p: m == "PUT" and p.endswith("fullparam_manifest.json"))  # the manifest's answer lost
    proxy.fail(lambda m, p: m == "PUT" and p.endswith("/latest"), 409, "ConditionalRequestConflict")
    out = publish_one(spec(snap, config(proxy.endpoint, bucket)))
    assert out["retried_requests"] == 7 and same_bytes(c, bucket, snap) and not open_uploads(c, bucket)
    # beyond publish.retries it fails with the store's code and the address, and no manifest is written
    snap2 = make_snapshot(tmp_path, 6)
    proxy.fail(is_part, 503, "SlowDown", times=100)
    with pytest.raises(StoreError, match=r"upload_part s3://.*/run/hf-step-000006/model-00001-of-00002.safetensors .* "
                                         r"after 3 attempts: SlowDown \(HTTP 503\)"):
        publish_one(spec(snap2, config(proxy.endpoint, bucket, retries=2)))
    assert f"run/{snap2.name}/fullparam_manifest.json" not in keys_under(c, bucket)


def test_the_probe_fails_with_the_stores_error_and_the_url(s3, moto, tmp_path):
    c, bucket, proxy = s3
    assert probe(Store(config(moto, bucket))) == [] and keys_under(c, bucket) == []  # the probe object is gone
    with pytest.raises(ProbeFailed, match=r"publish.url s3://no-such-bucket/run \(endpoint http://127.*NoSuchBucket"):
        probe(Store(config(moto, "no-such-bucket")))
    with pytest.raises(ProbeFailed, match=r"publish.url s3://.*/run \(endpoint http://127.0.0.1:1\).*EndpointConnectionError"):
        probe(Store(config("http://127.0.0.1:1", bucket, retries=1)))
    import boto3

    iam = boto3.client("iam", endpoint_url=moto, region_name="us-east-1")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    enforce_auth(moto, True)
    try:
        env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with pytest.raises(ProbeFailed, match=r"cannot write the probe object s3://.*AccessDenied \(HTTP 403\)"):
                probe(Store(config(moto, bucket)))
            mp.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
            with pytest.raises(ProbeFailed, match=r"InvalidAccessKeyId \(HTTP 403\)"):
                probe(Store(config(moto, bucket)))
    finally:
        enforce_auth(moto, False)


def test_a_store_ignoring_conditional_headers_is_found_at_the_probe(s3, tmp_path):
    c, bucket, proxy = s3
    proxy.ignore_conditions = True
    with pytest.raises(ProbeFailed, match=r"ignores If-None-Match: \* and If-Match .*require_conditional_writes=false"):
        probe(Store(config(proxy.endpoint, bucket)))
    warnings = probe(Store(config(proxy.endpoint, bucket)), require_conditional=False)
    assert len(warnings) == 1 and "one writer per prefix" in warnings[0]
    # what still holds with one writer: manifest last, latest forward only, bytes checked
    cfg = config(proxy.endpoint, bucket, require_conditional_writes=False)
    for step in (3, 2):
        snap = make_snapshot(tmp_path, step)
        publish_one(spec(snap, cfg))
        assert same_bytes(c, bucket, snap)
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"hf-step-000003\n"


def test_latest_never_moves_back_and_best_follows_the_local_best(s3, tmp_path):
    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket)
    late, early = make_snapshot(tmp_path, 9), make_snapshot(tmp_path, 4)
    (tmp_path / "best").write_text(early.name + "\n")
    assert publish_one(spec(late, cfg))["latest"] == late.name
    out = publish_one(spec(early, cfg))
    assert out["latest"] == late.name and out["best"] == early.name
    assert c.get_object(Bucket=bucket, Key="run/best")["Body"].read() == b"hf-step-000004\n"


def test_a_lost_compare_and_swap_reads_again_and_latest_still_never_moves_back(s3, tmp_path):
    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket)
    publish_one(spec(make_snapshot(tmp_path, 3), cfg))

    def other_writer():  # another job moves latest to step 9 between our read and our write
        etag = c.head_object(Bucket=bucket, Key="run/latest")["ETag"]
        c.put_object(Bucket=bucket, Key="run/latest", Body=b"hf-step-000009\n", IfMatch=etag)

    raced = proxy.before(lambda m, p: m == "PUT" and p.endswith("/run/latest"), other_writer)
    proxy.seen.clear()
    out = publish_one(spec(make_snapshot(tmp_path, 5), cfg))
    assert raced.hits == 1 and out["latest"] == "hf-step-000009"
    assert c.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"hf-step-000009\n"
    assert proxy.count("PUT", "/run/latest") == 1  # our one conditional PUT, refused (412); then read again


def test_remote_retention_keeps_the_newest_and_the_best_by_the_metric(s3, tmp_path):
    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket, keep_last=1, keep_best=1)
    removed = []
    for step, loss in ((1, 3.0), (2, 1.0), (3, 4.0), (4, 2.0)):
        snap = make_snapshot(tmp_path, step, loss=loss, shard=1000)
        (tmp_path / "best").write_text("hf-step-000002\n" if step >= 2 else "hf-step-000001\n")
        removed += publish_one(spec(snap, cfg, metric="loss", mode="min"))["removed"]
    assert removed == ["hf-step-000001", "hf-step-000003"]
    assert sorted({k.split("/")[1] for k in keys_under(c, bucket)}) == ["best", "hf-step-000002", "hf-step-000004", "latest"]
    assert c.get_object(Bucket=bucket, Key="run/best")["Body"].read() == b"hf-step-000002\n"


def test_a_removal_cut_short_leaves_no_snapshot_and_the_next_retention_finishes_it(s3, tmp_path):
    from paddle_fullparam_callbacks import _faults

    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket, keep_last=1)
    publish_one(spec(make_snapshot(tmp_path, 1, shard=1000), cfg))

    def crash(point):
        if point == "publish_remove":
            raise KeyboardInterrupt("killed")  # the process dies right after the manifest's deletion

    _faults.HOOK = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            publish_one(spec(make_snapshot(tmp_path, 2, shard=1000), cfg))
    finally:
        _faults.HOOK = None
    left = keys_under(c, bucket, "run/hf-step-000001/")
    assert "run/hf-step-000001/.fullparam-deleting" in left and "run/hf-step-000001/config.json" in left
    assert "run/hf-step-000001/fullparam_manifest.json" not in left  # no longer a snapshot for any reader
    publish_one(spec(make_snapshot(tmp_path, 3, shard=1000), cfg))
    assert sorted({k.split("/")[1] for k in keys_under(c, bucket)}) == ["hf-step-000003", "latest"]


def test_a_local_file_that_changed_since_the_commit_is_never_published(s3, tmp_path):
    c, bucket, proxy = s3
    snap = make_snapshot(tmp_path, 8)
    shard = snap / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(LocalFileChanged, match="differs from its manifest"):
        publish_one(spec(snap, config(proxy.endpoint, bucket)))
    # the files checked before it may be there, but no manifest (not a snapshot), and nothing of the changed one
    left = keys_under(c, bucket, "run/hf-step-000008/")
    assert "run/hf-step-000008/fullparam_manifest.json" not in left and f"run/{snap.name}/{shard.name}" not in left
    assert open_uploads(c, bucket) == []


def test_a_snapshot_of_the_same_name_is_replaced_only_for_its_own_run(s3, tmp_path):
    c, bucket, proxy = s3
    cfg = config(proxy.endpoint, bucket)
    snap = make_snapshot(tmp_path, 2)
    publish_one(spec(snap, cfg))
    assert publish_one(spec(snap, cfg))["already_published"]
    again = make_snapshot(tmp_path / "again", 2, seed=1)  # a re-export of step 2 (after a resume)
    assert publish_one(spec(again, cfg))["replaced"] and same_bytes(c, bucket, again)
    other = make_snapshot(tmp_path / "other", 2, run="r2", seed=2)
    with pytest.raises(RemoteConflict, match="another snapshot \\(run r1, step 2\\)"):
        publish_one(spec(other, cfg, run="r2"))
    assert same_bytes(c, bucket, again)


def test_verify_checks_remote_snapshots_against_their_manifests(s3, moto, tmp_path):
    c, bucket, proxy = s3
    cfg = config(moto, bucket)
    for step in (1, 2):
        publish_one(spec(make_snapshot(tmp_path, step), cfg))
    env = {**os.environ, "AWS_ENDPOINT_URL": moto}
    ok = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "verify", "--json", f"s3://{bucket}/run"],
                        env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and [r["path"] for r in report["snapshots"]][:2] == [f"s3://{bucket}/run/hf-step-000001",
                                                                            f"s3://{bucket}/run/hf-step-000002"]
    one = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "verify", f"s3://{bucket}/run/hf-step-000002"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and one.stdout.startswith(f"OK  s3://{bucket}/run/hf-step-000002: 4 files"), one.stdout
    c.put_object(Bucket=bucket, Key="run/hf-step-000001/config.json", Body=b'{"model_type": "llamb"}')  # same size, other bytes
    c.put_object(Bucket=bucket, Key="run/hf-step-000009/config.json", Body=b"{}")  # no manifest: not a snapshot
    bad = subprocess.run([sys.executable, "-m", "paddle_fullparam_callbacks", "verify", f"s3://{bucket}/run"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "config.json: blake3 differs from the manifest" in bad.stdout, bad.stdout + bad.stderr
    assert "hf-step-000009: no fullparam_manifest.json: not a snapshot" in bad.stdout
