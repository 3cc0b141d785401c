"""The single-process part of ``bench/real_size.py``: one child process builds the model once and measures, in
turn, everything one process does with it (building it again costs 70 s and 15 GB at full size).

    python bench/_real_size_single.py --dims JSON --work DIR [--reps N] ...     # one JSON line on stdout

Not meant to be run by hand (``bench/real_size.py`` starts it). In order:

1. ``ref``: ``bench/export_single.py``'s 0.67 GB float32 Llama exported to the same disk by a callback the same
   way, ``--reps`` times (the seconds per byte the large model is compared with), then freed;
2. the model: PaddleFormers ``LlamaForCausalLM`` at ``--dims``, bfloat16, ``paddle.seed(0)``, on the CPU; the
   expected BLAKE3 of every tensor in the HF layout (``_real_size.hf_array``);
3. ``--reps`` rounds of: ``bf16`` (the live export: ``on_save`` of a callback with the defaults), its checks,
   ``cp -r`` of that snapshot + fsync, ``fp8`` (the same with ``export.quantization=fp8``) and its checks, ``raw``
   (a ``pwrite`` loop of the parameters' bytes + fsync: the disk's write rate for the same bytes);
4. ``async``, per case (``default``: the defaults; a fraction: ``export.max_pending_bytes`` set to that share of
   the snapshot, a ring that cannot hold it as on a host the model fills): ``on_train_begin``, the first
   ``on_step_end`` (the ring is sized from MemAvailable and faulted in then), ``--reps`` exports (each paired with a
   raw write just before it: the disk's rate of its floor) with ``--train-seconds`` of training between them, then
   ``on_train_end``; the stall of an export is its ``on_save`` plus the wait the next event has for it;
5. the PaddleFormers flex checkpoint of the model (``paddle.distributed.save_state_dict(model.sharded_state_dict())``
   as the Trainer's save calls it), for the conversion the parent times after this process is gone.

Every snapshot is checked: the first of each kind tensor by tensor (``snapshot_digests`` against the model's
digests; FP8: the tensors it does not quantize so, the quantized ones by transformers' ``Fp8Quantize`` in the hf
environment, ``tests/hf_client/check_real_size.py``, which also loads the bfloat16 snapshot on the meta device);
every one by ``verify`` (files against the manifest), and a later one's files must have the first one's BLAKE3.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common as C  # noqa: E402
import _real_size as R  # noqa: E402
from _real_size_checks import (  # noqa: E402
    check_again, check_first, expected_digests, hf_check, param_view, safetensors_digests, verify,
)

PIECE = 16 * 2**20  # bytes per pwrite of the raw writer
WRITEBACK, SYNC_FILE_RANGE_WRITE = 64 * 2**20, 2  # the raw writer starts writeback every 64 MB (as the export's)
QUIET_WAIT = 30.0  # seconds to wait at most for idle CPUs before a timed run
DISTURBED = 0.2  # others used more than this share of the CPUs during a run: it is repeated
RETRIES = C.tiny(3, 1)  # tries at most (the least disturbed is kept)
SHARD = {"size": "5GB"}
WRITER = {"stats": []}  # every export's writer breakdown (C.record_writer_stats), newest last  # export.max_shard_size of every export (--max-shard-size: the tiny mode's several files)


class Watch:
    """Peak RSS of this process and lowest MemAvailable of the machine over a region (every 10 ms)."""

    def __init__(self):
        import psutil

        self._proc, self._stop = psutil.Process(), threading.Event()

    def _sample(self):
        self.peak = max(self.peak, self._proc.memory_info().rss)
        self.low = min(self.low, R.meminfo()["MemAvailable"])

    def _run(self):
        while not self._stop.wait(0.01):
            self._sample()

    def __enter__(self):
        gc.collect()
        C.trim_heap()
        self.baseline = self.peak = self._proc.memory_info().rss
        self.low = R.meminfo()["MemAvailable"]
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._sample()
        self._stop.set()
        self._t.join()

    def row(self, **extra) -> dict:
        return {"seconds": round(self.seconds, 4), "peak_extra_rss_bytes": self.peak - self.baseline,
                "mem_available_low_bytes": self.low, **extra}


class Driver:
    """A callback driven as a Trainer drives it: ``on_train_begin``, ``on_step_end`` and ``on_save`` at each
    checkpoint step, ``on_train_end``. ``args`` holds the fields the callback reads of TrainingArguments."""

    def __init__(self, out: Path, overrides=()):
        from paddleformers.trainer.trainer_callback import TrainerControl, TrainerState

        from paddle_fullparam_callbacks import FullParamExportCallback

        self.cb = FullParamExportCallback(None, output_dir=str(out), overrides=[
            "on_error=raise", f"export.max_shard_size={SHARD['size']}", *overrides])
        self.args = types.SimpleNamespace(output_dir=str(out.parent / "trainer"), sharding="")
        self.state, self.control = TrainerState(), TrainerControl()

    def begin(self, model) -> None:
        self.cb.on_train_begin(self.args, self.state, self.control, model=model)

    def step_end(self, step: int, model) -> None:
        """A training step's end (the async ring is made at the first: ``ring_size.py``)."""
        self.state.global_step = step
        self.cb.on_step_end(self.args, self.state, self.control, model=model)

    def save(self, step: int, model):
        """The trainer's save at ``step``: ``on_step_end`` then ``on_save``, as both trainers call them."""
        self.step_end(step, model)
        self.cb.on_save(self.args, self.state, self.control, model=model)
        return self.cb.snapshots[-1]

    def wait_pending(self) -> float:
        """What the next trainer event waits for a background export (it does this first)."""
        t0 = time.perf_counter()
        self.cb._finish_pending(self.state)
        return time.perf_counter() - t0

    def end(self) -> float:
        t0 = time.perf_counter()
        self.cb.on_train_end(self.args, self.state, self.control)
        return time.perf_counter() - t0


# ---- the model ----------------------------------------------------------------------------------------
def build(d: dict):
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.set_device("cpu")
    paddle.set_default_dtype("bfloat16")
    paddle.seed(0)
    model = LlamaForCausalLM(LlamaConfig(**d))
    model.eval()
    return model


# ---- baselines ------------------------------------------------------------------------------------
def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")) + [root]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def cp_r(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    fsync_tree(dst)


def write_raw(path: Path, model) -> int:
    """Each parameter's bytes (shared, not copied) by a pwrite loop into one file allocated first (``fallocate``),
    writeback started every WRITEBACK bytes (``sync_file_range``), then fsync: the floor of writing ready bytes,
    done as the export's writer does it. On this ext4 disk each matters: the same 2.32 GB took 1.0-6.4 s without
    the allocation (delayed allocation at writeback) and 0.99-1.04 s with it; without the early writeback a 2 GB
    loop ran 1.4-1.5 GB/s, once 0.11 GB/s (2 GB of dirty pages flushed at the fsync)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    off = started = 0
    try:
        os.posix_fallocate(fd, 0, sum(param_view(p).nbytes for p in model.parameters()))
        for p in model.parameters():
            mv = memoryview(param_view(p).reshape(-1).view("uint8"))
            for i in range(0, len(mv), PIECE):
                off += os.pwrite(fd, mv[i:i + PIECE], off)
                if off - started >= WRITEBACK:
                    if libc.sync_file_range(fd, ctypes.c_int64(started), ctypes.c_int64(off - started),
                                            SYNC_FILE_RANGE_WRITE):
                        raise OSError(ctypes.get_errno(), "sync_file_range failed")
                    started = off
        os.fsync(fd)
    finally:
        os.close(fd)
    return off


def memcpy_gb_s() -> float:
    """The ring's fill rate: 8 arrays of 128 MB (tiny: 1 MB) copied once each, one after another, into one buffer
    faulted in before (as the ring is), on one thread; the best of 3 (fresh arrays each time). A single 256 MB
    array copied again and again runs near 12 GB/s here, these near 6: a ring fill copies many arrays once."""
    import numpy as np

    piece = C.tiny(128, 1) * 2**20
    ring = np.empty(8 * piece, np.uint8)
    ring.fill(0)
    best = None
    for _ in range(3):
        srcs = [np.full(piece, i, np.uint8) for i in range(8)]
        t0 = time.perf_counter()
        for i, src in enumerate(srcs):
            np.copyto(ring[i * piece:(i + 1) * piece], src)
        t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
        del srcs
    return round(ring.nbytes / 1e9 / best, 2)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _settle() -> dict:
    """No dirty pages of the last run in the next one's time; CPUs idle if they become so within QUIET_WAIT
    (the machine is shared: what it saw is recorded)."""
    os.sync()
    return C.wait_quiet(QUIET_WAIT)


# ---- the parts -----------------------------------------------------------------------------------
def ref_part(work: Path, reps: int) -> dict:
    """export_single's model to the same disk, driven the same way."""
    model = C.build_llama(seed=0)
    drv, rows = Driver(work / "ref"), []
    drv.begin(model)
    steps = iter(range(1, 10**6))
    for rep in range(reps):
        row, n = least_disturbed(lambda: drv.save(next(steps), model), after=_snapshot_bytes_removed)
        rows.append(dict(row, bytes=n))
    drv.end()
    out = {"model_bytes": C.parameter_bytes(model), "dtype": "float32", "config": C.LLAMA_KWARGS, "runs": rows}
    shutil.rmtree(work / "ref", ignore_errors=True)
    del model, drv
    gc.collect()
    C.trim_heap()
    return out


def least_disturbed(fn, discard=None, after=None, retry=True):
    """``fn()`` timed (Watch, CpuShare) after ``_settle()``, then ``after(value)`` untimed (what a try leaves, e.g.
    counted and removed); run again, up to RETRIES times, while other processes used more than DISTURBED of the
    CPUs meanwhile (the machine is shared), ``discard(value)`` on every value not kept. Returns (row, value) of
    the least disturbed try; the row counts the tries. ``retry=False`` (``cp``, the raw write): once, the share
    recorded only: the kernel's writeback of the run's own pages counts as others' CPU, so a run that only
    writes always looks disturbed."""
    best, tries = None, 0
    for tries in range(1, (RETRIES if retry else 1) + 1):
        q = _settle()
        with Watch() as w, C.CpuShare() as cpu:
            value = fn()
        value = after(value) if after is not None else value
        row = w.row(cpu=cpu.as_dict(), quiet=q)
        if best is None or row["cpu"]["foreign_fraction"] < best[0]["cpu"]["foreign_fraction"]:
            if best is not None and discard is not None:
                discard(best[1])
            best = (row, value)
        elif discard is not None:
            discard(value)
        if row["cpu"]["foreign_fraction"] <= DISTURBED:
            break
    best[0]["tries"] = tries
    return best


def sync_part(model, expected: dict, work: Path, reps: int, hf_python: str) -> dict:
    drv16, drv8 = Driver(work / "bf16"), Driver(work / "fp8", ["export.quantization=fp8"])
    drv16.begin(model)
    drv8.begin(model)
    runs = {"bf16": [], "cp": [], "fp8": [], "raw": []}
    checks = {"bf16": [], "fp8": [], "discarded": []}
    first = {}
    steps = iter(range(1, 10**6))

    def discard(info) -> None:  # a disturbed try's snapshot is checked too, then removed
        p = Path(info.path)
        kind = "fp8" if p.parent.name == "fp8" else "bf16"
        checks["discarded"].append(check_again(p, first[kind]) if kind in first else verify(p))
        shutil.rmtree(p)

    for rep in range(reps):
        row, (info, writer) = least_disturbed(lambda: drv16.save(next(steps), model), lambda v: discard(v[0]),
                                              after=lambda info: (info, _writer()))
        runs["bf16"].append(dict(row, bytes=info.bytes, timings=dict(info.timings), writer=writer))
        bf16 = Path(info.path)
        if rep == 0:
            checks["bf16"].append(check_first(bf16, expected))
            checks["hf_meta"] = hf_check(hf_python, bf16)
            first["bf16"] = safetensors_digests(bf16)
        else:
            checks["bf16"].append(check_again(bf16, first["bf16"]))
        copy = work / "cp_copy"
        row, n = least_disturbed(lambda: cp_r(bf16, copy), after=lambda _: _size_and_remove(copy), retry=False)
        runs["cp"].append(dict(row, bytes=n))
        row, (info8, writer) = least_disturbed(lambda: drv8.save(next(steps), model), lambda v: discard(v[0]),
                                               after=lambda info: (info, _writer()))
        fp8 = Path(info8.path)
        runs["fp8"].append(dict(row, bytes=info8.bytes, timings=dict(info8.timings), writer=writer, **_fp8_bytes(fp8)))
        if rep == 0:
            tensors = R.snapshot_tensors(fp8)
            plain = {n for n, t in tensors.items() if t[1] != "F8_E4M3" and not n.endswith("_scale_inv")}
            c = check_first(fp8, expected, plain)  # the tensors it does not quantize; the others in the hf env
            c["hf_fp8"] = hf_check(hf_python, fp8, bf16)
            c["ok"] = c["verify_ok"] and c["hf_fp8"]["ok"] and not c["tensors"]["differ"] and not c["tensors"]["missing"]
            checks["fp8"].append(c)
            first["fp8"] = safetensors_digests(fp8)
        else:
            checks["fp8"].append(check_again(fp8, first["fp8"]))
        shutil.rmtree(fp8)
        shutil.rmtree(bf16)
        raw = work / "raw.bin"
        row, n = least_disturbed(lambda: write_raw(raw, model), after=lambda _: _size_and_remove(raw), retry=False)
        runs["raw"].append(dict(row, bytes=n))
    drv16.end()
    drv8.end()
    return {"runs": runs, "checks": checks, "first_files_blake3": first["bf16"]}


def _size_and_remove(path: Path) -> int:
    n = sum(C.tree_bytes(path).values()) if path.is_dir() else path.stat().st_size
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    return n


def _writer() -> dict:
    """The kept try's writer: seconds per stage summed over its threads (copies, casts, hash, pwrite, waits)."""
    stats = WRITER["stats"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in (stats[-1] if stats else {}).items()}


def _snapshot_bytes_removed(info) -> int:
    shutil.rmtree(info.path)
    return info.bytes


def _fp8_bytes(snapshot: Path) -> dict:
    tensors = R.snapshot_tensors(snapshot)
    q = sum(t[4] - t[3] for n, t in tensors.items() if t[1] == "F8_E4M3" or n.endswith("_scale_inv"))
    return {"tensor_bytes": sum(t[4] - t[3] for t in tensors.values()), "quantized_part_bytes": q}


def async_part(model, case: str, work: Path, reps: int, train_s: float, first_bf16: dict, expected: dict,
               snapshot_bytes: int) -> dict:
    """Each export paired with a raw write of the same bytes just before it, with the ring already taken (the
    disk's rate varies by the minute here, and the ring's memory is memory the page cache no longer has): the
    floor of that export is computed from that write. A snapshot is checked and removed once committed."""
    overrides = ["export.async_write=true"]
    if case != "default":
        overrides.append(f"export.max_pending_bytes={max(1, int(float(case) * snapshot_bytes))}B")
    drv = Driver(work / f"async-{case}", overrides)
    drv.begin(model)
    before = R.meminfo()["MemAvailable"]
    with Watch() as setup:
        drv.step_end(1, model)  # the first step's end: the ring is sized from MemAvailable now, and faulted in
    ring = drv.cb.session._ring.size if drv.cb.session._ring is not None else 0
    stalls, totals, checks, raw_s, at_export, foreign = [], [], [], [], [], []

    def finished(info) -> None:
        p = Path(info.path)
        totals.append(info.seconds)
        checks.append(check_first(p, expected) if not checks else check_again(p, first_bf16))
        if len(checks) == 1:
            checks[0]["same_files_as_sync"] = safetensors_digests(p) == first_bf16
        shutil.rmtree(p)

    watched = []  # the exports' own regions (save, training, the waits), not the raw writes and the checks

    for rep in range(reps):
        if rep:
            with Watch() as w:
                stalls[-1] += drv.wait_pending()  # the next save first waits for the previous export
            watched.append(w)
            finished(drv.cb.snapshots[-1])
        _settle()
        t0 = time.perf_counter()
        write_raw(work / "raw.bin", model)
        raw_s.append(time.perf_counter() - t0)
        (work / "raw.bin").unlink()
        _settle()
        at_export.append(R.meminfo()["MemAvailable"])
        with Watch() as w:
            with C.CpuShare() as cpu:
                t0 = time.perf_counter()
                drv.save(100 + rep, model)
                stalls.append(time.perf_counter() - t0)
            time.sleep(train_s)  # training goes on; the writer drains the ring meanwhile
        watched.append(w)
        foreign.append(round(cpu.foreign_fraction, 3))
    with Watch() as w:
        stalls[-1] += drv.end()
    watched.append(w)
    finished(drv.cb.snapshots[-1])
    out = {"case": case, "ring_bytes": ring, "mem_available_before_bytes": before,
           "mem_available_after_ring_bytes": setup.low, "mem_available_at_export_bytes": at_export,
           "setup_seconds": round(setup.seconds, 3), "setup_extra_rss_bytes": setup.peak - setup.baseline,
           "stalls_s": [round(s, 4) for s in stalls], "raw_s": [round(s, 4) for s in raw_s],
           "others_cpu_share_in_save": foreign,
           "export_seconds": [round(s, 4) for s in totals], "train_seconds": train_s,
           "peak_extra_rss_bytes": max(w.peak for w in watched) - setup.baseline,
           "mem_available_low_bytes": min([w.low for w in watched] + [setup.low]),
           "checks": checks}
    del drv
    gc.collect()
    C.trim_heap()
    return out


def checkpoint_part(model, d: dict, root: Path, parts: int) -> dict:
    """The flex checkpoint, as the Trainer's save writes it: one ``save_state_dict`` call when its 2x fits in the
    memory available now, else as pipeline ranks would write it, part by part (``parts`` > 0: that many)."""
    import paddle.distributed as dist

    ckpt = root / "checkpoint-1" / "model_state"
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(dict(d, architectures=["LlamaForCausalLM"], dtype="bfloat16")))
    sd = model.sharded_state_dict()
    total = R.model_bytes(d)
    room = R.meminfo()["MemAvailable"] - R.GB  # a margin: the machine is shared
    limit = -(-total // parts) if parts else (total if R.PF_SAVE_FACTOR * total <= room else int(room / R.PF_SAVE_FACTOR))
    with Watch() as w:
        if limit >= total:
            dist.save_state_dict(sd, str(ckpt))
            n = 1
        else:
            n = save_in_parts(sd, root, ckpt, max(limit, R.largest_tensor_bytes(d)))
    return w.row(parts=n, part_limit_bytes=limit, mem_available_bytes=room + R.GB, files=C.tree_bytes(ckpt))


def save_in_parts(sd: dict, root: Path, ckpt: Path, limit: int) -> int:
    """Paddle's ``save_state_dict`` holds twice the tensors it saves besides them (numpy copies of all, then
    pickle's bytes of each, alive until the dump ends: measured 2.00x): a 15 GB model cannot be saved from a
    24 GB host in one call. Consecutive tensors of at most ``limit`` bytes (or one larger tensor) are saved by
    one call each, and the parts' metadata merged as ``save_state_dict``'s coordinator merges its ranks'
    (``{rank}_0.distcp`` files, one ``0.metadata``): the checkpoint a pipeline-parallel job of that many ranks
    writes. Returns the number of parts."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.metadata import Metadata
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import dedup_key_in_dict
    from paddle.distributed.flex_checkpoint.dcp.utils import merge_state_dict_metadata

    groups, acc = [[]], 0
    for k, sw in sd.items():
        n = int(sw.local_tensor.numel()) * sw.local_tensor.element_size()
        if groups[-1] and acc + n > limit:
            groups.append([])
            acc = 0
        groups[-1].append(k)
        acc += n
    metas = []
    ckpt.mkdir(parents=True, exist_ok=True)
    for i, group in enumerate(groups):
        part = root / f"part-{i}"
        paddle.distributed.save_state_dict({k: sd[k] for k in group}, str(part))
        metas.append(paddle.load(str(part / "0.metadata")))
        os.replace(part / "0_0.distcp", ckpt / f"{i}_0.distcp")
        shutil.rmtree(part)
        gc.collect()
    merged = Metadata(state_dict_metadata=merge_state_dict_metadata([m.state_dict_metadata for m in metas]),
                      storage_metadata={lti: f"{i}_0.distcp" for i, m in enumerate(metas) for lti in m.storage_metadata},
                      flat_mapping=dedup_key_in_dict([m.flat_mapping for m in metas]))
    paddle.save(merged, str(ckpt / "0.metadata"))
    return len(groups)


def pf_part(d: dict, work: Path, reps: int) -> dict:
    """``save_pretrained`` (what PaddleFormers users run today) against the callback's export, same model, same
    disk, alternating; at ``d``'s size (the parent picks the largest that fits beside the model)."""
    model = build(d)
    drv, runs = Driver(work / "pf_ours"), {"ours": [], "save_pretrained": []}
    drv.begin(model)
    for rep in range(reps):
        for v in (("ours", "save_pretrained") if rep % 2 == 0 else ("save_pretrained", "ours")):
            _settle()
            if v == "ours":
                with Watch() as w:
                    info = drv.save(rep + 1, model)
                runs[v].append(w.row(bytes=info.bytes, verify_ok=verify(Path(info.path))["verify_ok"]))
                shutil.rmtree(info.path)
            else:
                target = work / "pf_save"
                with Watch() as w:
                    model.save_pretrained(str(target), save_checkpoint_format="flex_checkpoint", max_shard_size=SHARD["size"])
                    os.sync()
                runs[v].append(w.row(bytes=sum(C.tree_bytes(target).values())))
                shutil.rmtree(target)
    drv.end()
    return {"model_bytes": C.parameter_bytes(model), "layers": d["num_hidden_layers"], "runs": runs,
            "call": 'model.save_pretrained(dir, save_checkpoint_format="flex_checkpoint", max_shard_size="5GB"); os.sync()'}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", required=True)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--part", choices=("single", "pf"), default="single")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--ref-reps", type=int, default=1)
    ap.add_argument("--async-cases", default="default")
    ap.add_argument("--async-reps", type=int, default=2)
    ap.add_argument("--train-seconds", type=float, default=0.0, help="0: 1.5x the synchronous export's median")
    ap.add_argument("--checkpoint-parts", type=int, default=0, help="0: as many as memory needs (checkpoint_part)")
    ap.add_argument("--hf-python", default="")
    ap.add_argument("--max-shard-size", default="5GB")
    ns = ap.parse_args()
    SHARD["size"] = ns.max_shard_size
    C.quiet_logs()
    d = json.loads(ns.dims)
    ns.work.mkdir(parents=True, exist_ok=True)
    if ns.part == "pf":
        print(json.dumps(pf_part(d, ns.work, ns.reps)), flush=True)
        return
    WRITER["stats"] = C.record_writer_stats()
    out = {"oom_kills_before": R.oom_kills(), "memcpy_gb_s": memcpy_gb_s()}
    out["ref"] = ref_part(ns.work, ns.ref_reps)
    t0 = time.perf_counter()
    model = build(d)
    out["build_seconds"] = round(time.perf_counter() - t0, 1)
    out["model_bytes"] = C.parameter_bytes(model)
    out["rss_with_model_bytes"] = C.rss_bytes()
    out["mem_available_with_model_bytes"] = R.meminfo()["MemAvailable"]
    t0 = time.perf_counter()
    expected = expected_digests(model, d)
    out["expected_digests_seconds"] = round(time.perf_counter() - t0, 1)
    out["expected"] = {k: list(v) for k, v in expected.items()}
    out["sync"] = sync_part(model, expected, ns.work, ns.reps, ns.hf_python)
    snap_bytes = out["sync"]["runs"]["bf16"][0]["bytes"]
    train_s = ns.train_seconds or max(0.2, round(1.5 * C.median([r["seconds"] for r in out["sync"]["runs"]["bf16"]]), 1))
    out["async"] = [async_part(model, case, ns.work, ns.async_reps, train_s, out["sync"]["first_files_blake3"],
                               expected, snap_bytes) for case in ns.async_cases.split(",") if case]
    out["checkpoint"] = checkpoint_part(model, d, ns.work / "ckpt", ns.checkpoint_parts)
    out["oom_kills_after"] = R.oom_kills()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
