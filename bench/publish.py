"""The publisher: its throughput against boto3's own transfer manager, and the training stall with
publishing on and off.

Run (several minutes; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    $PY bench/publish.py                   # -> bench/results/publish.json
    $PY bench/publish.py --reps 5 --shard-mb 128

The store is moto's S3 server (``ThreadedMotoServer``) in a process of its own on a loopback port, so
its CPU is not the measured process's; both sides talk real HTTP to the same server.

- *throughput*: the same snapshot (``--shards`` files of ``--shard-mb`` MB and its small files) goes to a
  fresh prefix, paired in each repetition, order alternating: once by the publisher's engine
  (``engine.publish_one``: BLAKE3 of every byte against the manifest, Content-MD5 per request, the ETag
  checked per part and per object, the manifest last, ``latest``), once by ``boto3``'s
  ``S3Transfer.upload_file`` for each file with the same part size and concurrency (what a user's own
  script would do, default client settings). The ratio is the publisher's MB/s over upload_file's
  (medians of the pairs).
- *stall*: as ``eval_stall.py``, a child makes ``--exports`` exports of the ~670 MB float32 Llama
  through ``ExportSession`` and between them "trains" (``--steps`` steps of float32 matrix products on
  every core, each followed by the hook's drain, as the callback drains at every trainer event);
  ``on`` attaches the publish hook (each snapshot published by a runner process at nice 10), ``off``
  does not. The stall of an export is the training thread's time for it: ``export()`` plus every
  drain until the next export; *training seconds* say how much the publishing process slowed the
  training's own work.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "publish.json"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
SERVER = r'''
import logging, os, sys
from moto.server import ThreadedMotoServer
# the store stands for another machine: on this 2-core one it yields the CPU (nice 19, and its own session's
# autogroup, as the runner does), so what the stall measures is the publisher's cost, not the server's
os.nice(19)
try:
    open("/proc/self/autogroup", "w").write("19")
except OSError:
    pass
logging.getLogger("werkzeug").setLevel(logging.ERROR)
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print("http://%s:%d" % s.get_host_and_port(), flush=True)
sys.stdin.read()
'''


def start_server():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, proc.stdout.readline().strip()


def make_snapshot(root: Path, shards: int, shard_mb: int) -> Path:
    from paddle_fullparam_callbacks.export.write import checksum

    snap = root / "hf-step-000001"
    snap.mkdir(parents=True)
    files = {}
    for i in range(shards):
        p = snap / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(p, "wb") as f:
            for _ in range(shard_mb):
                f.write(os.urandom(2**20))
        files[p.name] = p
    (snap / "config.json").write_text('{"model_type": "llama"}')
    files["config.json"] = snap / "config.json"
    manifest = {"manifest_version": 1, "snapshot": snap.name, "step": 1, "checksum": "blake3",
                "run": {"id": "bench", "seq": 1}, "created_unix": time.time(), "metrics": {},
                "files": {n: {"bytes": p.stat().st_size, "blake3": checksum.digest_of_file(p, "blake3")}
                          for n, p in files.items()}}
    (snap / "fullparam_manifest.json").write_text(json.dumps(manifest))
    return snap


def throughput(endpoint: str, reps: int, shards: int, shard_mb: int, part_mb: int, concurrency: int) -> dict:
    import dataclasses

    import boto3
    from boto3.s3.transfer import S3Transfer, TransferConfig

    from paddle_fullparam_callbacks.config.schema import PublishConfig
    from paddle_fullparam_callbacks.consumers.publish.engine import publish_one

    root = Path(tempfile.mkdtemp(prefix="pfc_publish_bench_"))
    c = boto3.client("s3", endpoint_url=endpoint)
    c.create_bucket(Bucket="bench")
    try:
        snap = make_snapshot(root, shards, shard_mb)
        total = sum(p.stat().st_size for p in snap.iterdir())
        cfg = PublishConfig(url="s3://bench/pub", endpoint_url=endpoint, part_size=f"{part_mb}MiB",
                            max_memory=f"{part_mb * (concurrency + 1)}MiB", concurrency=concurrency)
        tcfg = TransferConfig(multipart_threshold=part_mb * 2**20, multipart_chunksize=part_mb * 2**20,
                              max_concurrency=concurrency, use_threads=True)
        transfer = S3Transfer(c, tcfg)
        rows = []
        for rep in range(reps):
            row = {}
            order = ("publisher", "upload_file") if rep % 2 == 0 else ("upload_file", "publisher")
            for method in order:
                C.wait_quiet(max_wait=20)
                prefix = f"{method}-{rep}"
                t = time.perf_counter()
                if method == "publisher":
                    work = root / f"work-{rep}"
                    work.mkdir()
                    spec = {"snapshot": str(snap), "name": snap.name, "step": 1, "output_dir": str(root), "work": str(work),
                            "publish": {**dataclasses.asdict(cfg), "url": f"s3://bench/{prefix}"},
                            "name_template": "hf-step-{step:06d}", "run_id": "bench", "other_runs": "keep",
                            "metric": None, "mode": "min"}
                    publish_one(spec)
                else:
                    for p in sorted(snap.iterdir()):
                        transfer.upload_file(str(p), "bench", f"{prefix}/{snap.name}/{p.name}")
                row[method] = time.perf_counter() - t
                keys = [o["Key"] for o in c.list_objects_v2(Bucket="bench", Prefix=prefix + "/").get("Contents", [])]
                c.delete_objects(Bucket="bench", Delete={"Objects": [{"Key": k} for k in keys]})
            row["ratio"] = row["upload_file"] / row["publisher"]  # the publisher's MB/s over upload_file's
            rows.append(row)
            print(f"rep {rep}: publisher {row['publisher']:.2f} s ({total / 1e6 / row['publisher']:.0f} MB/s), "
                  f"upload_file {row['upload_file']:.2f} s ({total / 1e6 / row['upload_file']:.0f} MB/s), "
                  f"ratio {row['ratio']:.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {m: C.median([r[m] for r in rows]) for m in ("publisher", "upload_file")}
    return {"bytes": total, "files": shards + 2, "part_mb": part_mb, "concurrency": concurrency,
            "seconds_median": med, "mb_per_s_median": {m: round(total / 1e6 / s, 1) for m, s in med.items()},
            "throughput_ratio_median": round(C.median([r["ratio"] for r in rows]), 4), "pairs": rows}


def child(variant: str, out: Path, endpoint: str, exports: int, steps: int, prefix: str) -> dict:
    C.quiet_logs()

    from paddle_fullparam_callbacks.config import load_config
    from paddle_fullparam_callbacks.export import ExportSession
    from paddle_fullparam_callbacks.consumers.publish.hook import PublishHook
    from paddle_fullparam_callbacks.models.model_info import build_model_source

    over = [f"output_dir={out}", "export.max_shard_size=5GB"]
    if variant == "on":
        over += [f"publish.url=s3://bench/{prefix}", f"publish.endpoint_url={endpoint}"]
    cfg = load_config(None, over)
    model = C.build_llama(seed=0)
    session = ExportSession(cfg, out)
    session.start()
    source = build_model_source(model, cfg)
    session.prepare(source)
    hook, committed_s, statuses = None, [], []
    if variant == "on":
        hook = PublishHook(cfg, out, session.run_id)

        def on_commit(job):  # what the callback's commit hook does, timed
            t = time.perf_counter()
            hook.committed(job.name, Path(job.out_dir) / job.name, job.step)
            committed_s.append(time.perf_counter() - t)

        session.committer.on_commit = on_commit
        session.committer.busy = hook.busy
    work = C.TrainingWork(768)
    stalls, train_s, drains = [], [], []
    for step in range(1, exports + 1):
        t = time.perf_counter()
        session.export(source, step, reason="bench")
        stalls.append(time.perf_counter() - t)
        t_train = time.perf_counter()
        for _ in range(steps):
            work.step()
            if hook is not None:
                td = time.perf_counter()
                statuses += [p.status for p in hook.drain()]
                d = time.perf_counter() - td
                drains.append(d)
                stalls[-1] += d
        train_s.append(time.perf_counter() - t_train)
    if hook is not None:
        hook.close(3600)
        statuses += [p.status for p in hook.drain()]
    session.close()
    return {"variant": variant, "stalls": stalls, "train_seconds": train_s, "publications": statuses,
            "hook_seconds_per_commit": committed_s,
            "drain_seconds": {"median": C.median(drains) if drains else 0.0, "max": max(drains) if drains else 0.0}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=("off", "on"))
    ap.add_argument("--out")
    ap.add_argument("--endpoint")
    ap.add_argument("--prefix", default="stall")
    ap.add_argument("--reps", type=int, default=C.tiny(5, 1))
    ap.add_argument("--stall-reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--shard-mb", type=int, default=C.tiny(128, 6))  # tiny: still a multipart upload (5 MiB parts)
    ap.add_argument("--part-mb", type=int, default=C.tiny(16, 5))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--exports", type=int, default=C.tiny(3, 2))
    ap.add_argument("--steps", type=int, default=C.tiny(25, 2))
    ns = ap.parse_args()
    os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
    if ns.variant:
        print(json.dumps(child(ns.variant, Path(ns.out), ns.endpoint, ns.exports, ns.steps, ns.prefix)))
        return
    server, endpoint = start_server()
    try:
        tput = throughput(endpoint, ns.reps, ns.shards, ns.shard_mb, ns.part_mb, ns.concurrency)
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")  # exists already: fine for moto
        runs = {"off": [], "on": []}
        for rep in range(ns.stall_reps):
            for v in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                C.wait_quiet(max_wait=30)
                tmp = Path(tempfile.mkdtemp(prefix="pfc_publish_stall_"))
                try:
                    r = C.run_child([__file__, "--variant", v, "--out", str(tmp / "out"), "--endpoint", endpoint,
                                     "--exports", str(ns.exports), "--steps", str(ns.steps), "--prefix", f"stall-{rep}"],
                                    timeout=1800)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                runs[v].append(r)
                print(f"stall rep {rep} {v}: stalls {[round(x, 3) for x in r['stalls']]} s, training "
                      f"{[round(x, 2) for x in r['train_seconds']]} s, publications {r['publications']}", flush=True)
    finally:
        server.stdin.close()
        server.wait(30)
    stall = {v: C.median([s for r in runs[v] for s in r["stalls"]]) for v in runs}
    train = {v: C.median([s for r in runs[v] for s in r["train_seconds"]]) for v in runs}
    hook = [s for r in runs["on"] for s in r["hook_seconds_per_commit"]]
    result = {
        "benchmark": "publish", "throughput": tput,
        "stall": {"repetitions": ns.stall_reps, "exports_per_run": ns.exports, "steps_between_exports": ns.steps,
                  "stall_seconds_median": stall, "extra_stall_seconds_on_vs_off": round(stall["on"] - stall["off"], 4),
                  "train_seconds_per_interval_median": train,
                  "training_slowdown_on_vs_off": round(train["on"] / train["off"], 4),
                  "hook_seconds_per_commit_max": max(hook) if hook else None,
                  "publications": {st: sum(s == st for r in runs["on"] for s in r["publications"])
                                   for st in ("ok", "skipped", "failed", "unfinished")},
                  "runs": runs},
        "notes": ["store: moto 5.2.5's S3 server in its own process on loopback, at nice 19 in its own session (it "
                  "stands for another machine); a Python server: it, not the network, bounds both sides' MB/s here",
                  "stall: each run publishes to a fresh prefix (a new run may not replace another run's snapshots)",
                  "ratio = upload_file seconds / publisher seconds for the same files in the same repetition"],
    }
    C.write_result(RESULT_PATH, result)
    print(f"\nthroughput: publisher {tput['mb_per_s_median']['publisher']} MB/s, upload_file "
          f"{tput['mb_per_s_median']['upload_file']} MB/s, ratio {tput['throughput_ratio_median']}")
    print(f"stall per export: off {stall['off']:.3f} s, on {stall['on']:.3f} s; training per interval off "
          f"{train['off']:.2f} s, on {train['on']:.2f} s (x{result['stall']['training_slowdown_on_vs_off']})")


if __name__ == "__main__":
    main()
