"""Every benchmark in bench/ runs once at its tiny size and writes its JSON (issue 33: no benchmark rots
between measurements).

``PFC_BENCH_TINY=1`` (bench/_common.py) makes a benchmark run its smallest model, one repetition and one
case of each kind, and ``PFC_BENCH_RESULTS`` sends its JSON into this module's temporary folder. Each
benchmark runs as ``make bench`` runs it (its own process; its children, launches, network namespaces,
fake accelerator and S3 server real), two at a time (``TinyRuns``); its test checks that it exited 0,
that its JSON holds the fields docs/performance.md cites and the checks the benchmark makes of the
bytes it moved, and that bench/results (the recorded figures) is untouched. The real runs stay in
``make bench``; no figure is judged here.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RECORDED = BENCH / "results"
HELPERS = {"_common", "assembler_ranks", "_real_size", "_real_size_checks", "_real_size_single",
           "_real_size_ranks", "_real_size_summary"}  # imported or launched by the benchmarks below, not run alone
TIMEOUT_S = 480
# reads those benchmarks' JSONs (so it runs after them; a missing one stops it: test_a_missing_input_stops_the_benchmark)
NEEDS = {"thread_scaling": ("export_single",), "export_ranks": ("assembler", "export_single")}
LAUNCHES = {"export_ranks", "assembler", "nodes_traffic", "visibility", "export_fp8", "real_size"}  # start paddle.distributed.launch

# benchmark: {path in its JSON: None (present) or the value it must have}; the longest tiny runs first
BENCHES = {
    "export_single": {("regimes", "tmpfs", "ratio_vs_raw"): None, ("regimes", "tmpfs", "bf16_ratio_vs_raw_bf16"): None,
                      ("regimes", "tmpfs", "bf16_ratio_vs_raw_bf16_cast"): None,
                      ("regimes", "tmpfs", "speedup_2_threads_vs_1"): None,
                      ("regimes", "tmpfs", "peak_extra_rss_fraction", "ours"): None,
                      ("regimes", "tmpfs", "breakdown_ours", "writer", "hash_s"): None,
                      ("regimes", "disk", "seconds", "paddleformers"): None, ("regimes", "disk", "seconds", "raw"): None,
                      ("facts", "writes_256MB", "tmpfs", "pwrite_page_cache_gb_s"): None},
    "assembler": {("routed_max_received_over_writes",): None, ("routed_received_over_snapshot_mp2",): None,
                  ("routed_over_seed_seconds_4ranks",): None, ("plan_50k_seconds",): None, ("replan_50k_seconds",): None,
                  ("figures", "bytes_checks_ok"): True,
                  ("assembly", "cases", "mp2xpp2", "routed_own_equals_predicted_equals_floor"): True,
                  ("assembly", "cases", "ep_data_dp2xmp2", "variants", "paddle", "not_run"): None},
    "visibility": {("one_node_4_ranks", "files_ms_median"): None, ("two_nodes_2x2_ranks", "exchange_ms_median"): None,
                   ("two_nodes_2x2_ranks", "ranks_measured"): 4},
    "convert": {("seconds", "convert"): None, ("seconds", "convert_workers2"): None,
                ("median_paired_ratio_vs_raw_copy",): None, ("peak_extra_rss_bytes", "VmRSS"): None,
                ("peak_extra_rss_ratio",): None, ("extra_rss_at_export_bytes", "RssAnon"): None,
                ("median_paired_ratio_cold_vs_raw_copy",): None, ("prepare_s_cold",): None},
    "export_ranks": {("regimes", "tmpfs", "ratio_vs_raw"): None,
                     ("regimes", "disk", "variants", "ours", "aggregate_gb_s"): None,
                     ("regimes", "tmpfs", "files_per_rank", "3"): None,
                     ("scaling_model", "predictions_s", "100Gb/s links, 2 NVMe per node", "ours_mp8xpp8",
                      "total_s"): None},
    "export_fp8": {("single", "regimes", "tmpfs", "median_paired_time_ratio"): None,
                   ("single", "regimes", "tmpfs", "quantized_bytes_ratio"): None,
                   ("single", "regimes", "tmpfs", "peak_extra_rss_bytes", "fp8"): None,
                   ("single", "facts", "one_thread_ns_per_element"): None,
                   ("ranks", "regimes", "tmpfs", "median_paired_time_ratio"): None,
                   ("ranks", "regimes", "tmpfs", "quantized_bytes_ratio"): None},
    "real_size": {("table", "live", "ratio_vs_cp", "median_paired"): None, ("table", "live", "peak_extra_rss_fraction"): None,
                  ("table", "live", "seconds_per_byte_ratio_vs_ref"): None,
                  ("table", "live", "save_pretrained", "ratio", "median_paired"): None,
                  ("table", "fp8", "time_ratio", "median_paired"): None, ("table", "fp8", "quantized_bytes_ratio"): None,
                  ("table", "async", 0, "ring_bytes"): None, ("table", "async", 1, "stall_over_floor"): None,
                  ("table", "mp2", "per_rank", "1", "as_predicted"): True, ("table", "mp2", "time_ratio"): None,
                  ("table", "convert", "ratio_vs_raw_copy", "median_paired"): None,
                  ("table", "convert", "peak_extra_rss_fraction"): None, ("checks", "bf16_first_tensor_by_tensor"): True,
                  ("checks", "bf16_transformers_meta"): True, ("checks", "fp8_first"): True, ("checks", "async_snapshots"): True,
                  ("checks", "convert_tensor_by_tensor_and_meta"): True, ("checks", "mp2_halves_verify_meta"): True,
                  ("checks", "no_oom_kill"): True},
    "lora_merge": {("regimes", "tmpfs", "time_ratio_merged_vs_plain"): None,
                   ("regimes", "tmpfs", "peak_extra_rss_bytes", "merged"): None,
                   ("regimes", "tmpfs", "snapshot_bytes", "merged_adapter"): None},
    "nodes_traffic": {("cases", "mp2xpp2", "link", "seed", "a_to_b_bytes"): None,
                      ("cases", "mp2xpp2", "link", "routed", "crossing_bytes"): None,
                      ("cases", "mp2xpp2", "nodes_seen_by_the_plan", "3"): [0, 0, 1, 1], ("namespaces_removed",): True},
    "async_stall": {("stall_ratio",): None, ("stall_seconds", "async"): None, ("peak_extra_rss_fraction", "async"): None,
                    ("stall_table", 0, "stall_ratio"): None, ("stall_table", 1, "stall_ratio"): None,
                    ("verified",): True},
    "profile_export": {("variants", "ours", "after", "cpu_s_by_stage_median"): None,
                       ("variants", "lora_merged", "before", "export_seconds_median"): None},
    "profile_convert": {("trees_results", "after", "cpu_s_by_stage_median"): None,
                        ("trees_results", "before", "seconds_median"): None,
                        ("trees_results", "after", "prepare_s_median"): None},
    "eval_stall": {("hook_seconds_per_export_max", "on"): None, ("extra_stall_seconds_on_vs_off",): None,
                   ("training_slowdown_vs_off", "on_nice0"): None, ("evaluations_ok",): True},
    "copy_floor": {("sizes", "2.75GB", "median_paired_ratio_vs_cp"): None,
                   ("sizes", "2.75GB", "seconds", "pwrite"): None, ("met",): None},
    "serve": {("sizes", "tiny", "swap", "commit_to_served_s_median"): None,
              ("sizes", "tiny", "swap", "bare_reload_s_median"): None, ("sizes", "tiny", "swap", "restart_s_median"): None,
              ("sizes", "tiny", "stall", "stall_ratio_on_vs_off"): None, ("sizes", "tiny", "stall", "swaps_ok"): True,
              ("sizes", "tiny", "adapter", "ratio_adapter_over_weights"): None,
              ("sizes", "tiny", "adapter", "commit_to_served_s_median", "adapter"): None,
              ("sizes", "tiny", "adapter", "engine_paused_in_adapter_mode"): False,
              ("sizes", "tiny", "adapter", "decode", "in_place_over_plain"): None,
              ("sizes", "tiny", "stall", "lora_stall_ratio_vs_off", "adapter"): None},
    "lm_eval": {("scoring", "tiny", "ratio_ours_vs_cli_median"): None, ("scoring", "tiny", "same_metrics"): True,
                ("scoring", "tiny", "cpu_ratio_ours_vs_cli_median"): None,
                ("stall", "stall_ratio_on_vs_off"): None, ("stall", "training_slowdown_on_vs_off"): None,
                ("stall", "evaluations_ok"): True},
    "publish": {("throughput", "throughput_ratio_median"): None, ("throughput", "mb_per_s_median", "publisher"): None,
                ("stall", "stall_seconds_median", "on"): None, ("stall", "hook_seconds_per_commit_max"): None,
                ("stall", "publications", "ok"): 2, ("stall", "publications", "failed"): 0},
    "gil": {("operations", "python_loop (control)", "scaling"): None,
            ("operations", "transposed_copy_into", "one_thread_gb_s"): None,
            ("operations", "pwrite_tmpfs_16MB", "scaling"): None},
    "device_stall": {("stall_ratio_device_over_cpu", "async"): None, ("device_peak_bytes", "device_bf16_budget0"): None,
                     ("within_budget", "device_async"): True, ("within_budget", "device_bf16_budget0"): True,
                     ("verified",): True},
    "verify_fuzz": {("verify_fuzz_cases",): 44, ("verify_fuzz_tracebacks",): 0, ("verify_fuzz_escapes",): 0,
                    ("generator_errors",): 0},
    "run_startup": {("added_median_ms", "wheel_hook_on_ms"): None, ("added_median_ms", "clone_run_ms"): None,
                    ("added_cpu_median_ms", "wheel_hook_off_ms"): None, ("heavy_modules_added",): []},
    "real_layers": {("layers", "tiny", "check", "bytes_identical"): True,
                    ("layers", "tiny", "check", "control", "caught"): True,
                    ("layers", "tiny", "check", "declared_equals_quantized"): True,
                    ("layers", "tiny", "timed_fp8_snapshots_equal_checked"): True, ("all_bytes_identical",): True,
                    ("layers", "tiny", "median_paired_time_ratio"): None,
                    ("layers", "tiny", "cpu_ns_per_element", "fp8"): None,
                    ("layers", "tiny", "cpu_ns_per_element", "bf16"): None,
                    ("layers", "tiny", "fp8_extra_cpu_ns_per_quantized_element"): None,
                    ("layers", "tiny", "quantized_bytes_ratio"): None,
                    ("layers", "tiny", "peak_extra_rss_bytes", "fp8"): None,
                    ("layers", "tiny", "peak_memory_bytes"): None, ("layers", "tiny", "loadavg_1m", "fp8"): None,
                    ("layers", "tiny", "facts", "hf[704, 320]", "fp8_bytes_stages_ns", "encode"): None,
                    ("layers", "tiny", "fill_scaling", "speedup", "fp8_bytes", "two_threads"): None,
                    ("layers", "tiny", "one_thread", "speedup_2_threads_vs_1", "fp8"): None,
                    ("layers", "tiny", "user_sys_s", "fp8", "sys_s"): None},
    "thread_scaling": {("variants", "float32", "measured_s", "2"): None,
                       ("variants", "float32", "predicted_s", "24"): None,
                       ("variants", "bfloat16", "per_thread_gb_s", "hash"): None,
                       ("variants", "bfloat16", "bound_beyond_2_threads"): None},
}


def _digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*"))}


class TinyRuns:
    """Runs the chosen benchmarks tiny, two at a time, in ``BENCHES``' order (the longest first), never two
    that start a ``paddle.distributed.launch`` at once, nor one before the benchmark whose JSON it reads.
    Most of a tiny run is Python processes importing Paddle: two at a time keep both cores busy. The
    results folder is shared; no figure is judged here, so the runs beside each other change nothing."""

    def __init__(self, names, results: Path):
        self.results, self.env = results, dict(os.environ, PFC_BENCH_TINY="1", PFC_BENCH_RESULTS=str(results))
        self.done = {n: threading.Event() for n in names}
        self.pending, self.outcome, self.procs = list(names), {}, {}
        self.launching, self.closing = False, False
        self.turn = threading.Condition()
        self.threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _ready(self, name: str) -> bool:
        needs = NEEDS.get(name, ())
        return not (name in LAUNCHES and self.launching) and all(n not in self.done or self.done[n].is_set()
                                                                  for n in needs)

    def _worker(self) -> None:
        while True:
            with self.turn:
                while self.pending and not any(self._ready(n) for n in self.pending):
                    self.turn.wait()
                if not self.pending:
                    return
                name = next(n for n in self.pending if self._ready(n))
                self.pending.remove(name)
                self.launching |= name in LAUNCHES
            try:
                self.outcome[name] = self._run(name)
            except BaseException as e:  # reported by the bench's test
                self.outcome[name] = (None, f"{type(e).__name__}: {e}", 0.0)
            with self.turn:
                self.launching &= name not in LAUNCHES
                self.done[name].set()
                self.turn.notify_all()

    def _run(self, name: str):
        t0 = time.perf_counter()
        with open(self.results / f"{name}.log", "w+") as log:
            with self.turn:  # no run starts once close() has begun
                if self.closing:
                    return None, "not run: the module's tests ended first", 0.0
                proc = self.procs[name] = subprocess.Popen(
                    [sys.executable, str(BENCH / f"{name}.py")], cwd=str(self.results), env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=TIMEOUT_S)
                note = ""
            except subprocess.TimeoutExpired:
                self._stop(proc)
                note = f"\n(killed after {TIMEOUT_S} s)"
            log.seek(0)
            return proc.returncode, log.read() + note, time.perf_counter() - t0

    @staticmethod
    def _stop(proc) -> None:
        """SIGTERM to the bench's process group first (nodes_traffic removes its namespaces), then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def wait(self, name: str):
        assert self.done[name].wait(2 * TIMEOUT_S), f"bench/{name}.py: no outcome after {2 * TIMEOUT_S} s"
        return self.outcome[name]

    def close(self) -> None:
        with self.turn:
            self.closing = True
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                self._stop(proc)
        for t in self.threads:
            t.join(60)


@pytest.fixture(scope="module")
def recorded():
    """bench/results as it was before any tiny run started."""
    return _digests(RECORDED)


@pytest.fixture(scope="module")
def tiny_runs(request, tmp_path_factory, recorded):
    """The benchmarks this session's chosen tests name (and those they read), started at once."""
    chosen = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params}
    chosen |= {need for n in chosen for need in NEEDS.get(n, ())}
    runs = TinyRuns([n for n in BENCHES if n in chosen], tmp_path_factory.mktemp("bench_results"))
    yield runs
    runs.close()


def _at(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def test_every_benchmark_has_its_tiny_run():
    entry_points = {p.stem for p in BENCH.glob("*.py")} - HELPERS
    assert entry_points == set(BENCHES), "a benchmark in bench/ without its tiny run here (or one here gone from bench/)"


@pytest.mark.parametrize("name", list(BENCHES))
def test_benchmark_runs_tiny(name, tiny_runs, recorded, request):
    if name == "device_stall":
        request.getfixturevalue("fake_device")  # builds the plugin; a failed build fails, never skips
    for need in NEEDS.get(name, ()):
        rc, out, _ = tiny_runs.wait(need)
        assert rc == 0, f"{need} (needed by {name}) failed:\n{out[-6000:]}"
    rc, out, seconds = tiny_runs.wait(name)
    print(f"bench/{name}.py tiny: {seconds:.1f} s")
    assert rc == 0, f"bench/{name}.py exited {rc} after {seconds:.0f} s at its tiny size:\n{out[-6000:]}"
    path = tiny_runs.results / f"{name}.json"
    assert path.is_file(), f"bench/{name}.py wrote no {path.name} into PFC_BENCH_RESULTS:\n{out[-3000:]}"
    result = json.loads(path.read_text())
    assert result.get("tiny") is True
    assert "unavailable" not in result, f"bench/{name}.py could not measure here: {result.get('unavailable')}"
    for key, want in BENCHES[name].items():
        try:
            got = _at(result, key)
        except (KeyError, IndexError, TypeError):
            pytest.fail(f"{path.name} has no {'.'.join(map(str, key))}")
        if want is not None:
            assert got == want, f"{path.name}: {'.'.join(map(str, key))} = {got!r}, not {want!r}"
    assert _digests(RECORDED) == recorded, "a tiny run changed bench/results"


def test_no_tiny_run_changed_the_recorded_results(tiny_runs, recorded):
    for name in tiny_runs.done:
        tiny_runs.wait(name)
    assert _digests(RECORDED) == recorded


def test_a_tiny_run_refuses_the_recorded_results():
    """Told to write into bench/results, a tiny run stops before writing (thread_scaling reads the recorded
    export_single.json and builds no model: it gets as far as writing)."""
    before = _digests(RECORDED)
    env = dict(os.environ, PFC_BENCH_TINY="1", PFC_BENCH_RESULTS=str(RECORDED))
    proc = subprocess.run([sys.executable, str(BENCH / "thread_scaling.py")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "writes no figures into" in proc.stderr, proc.stdout + proc.stderr
    assert _digests(RECORDED) == before


def _run_bench(script: str, results: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PFC_BENCH_TINY="1", PFC_BENCH_RESULTS=str(results))
    return subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_a_missing_input_stops_the_benchmark(tmp_path):
    """Issue 42: a benchmark that reads another's JSON stops, naming the file or the figure and the benchmark that
    writes it, instead of using figures of its own (export_ranks' scaling model read a key the assembler benchmark no
    longer wrote, swallowed the error and used built-in rates); it does so before any launch; a --before that is not
    a checkout stops a paired benchmark too. None of them writes a JSON."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for script, needed, maker in (("export_ranks.py", "assembler.json", "bench/assembler.py"),
                                  ("thread_scaling.py", "export_single.json", "bench/export_single.py")):
        proc = _run_bench(script, empty)
        assert proc.returncode != 0 and f"{needed} is missing ({maker} writes it" in proc.stderr, proc.stderr[-3000:]
    partial = tmp_path / "partial"  # the assembler's JSON as the routed benchmark writes it, without the 4-rank case
    partial.mkdir()
    recorded = json.loads((RECORDED / "assembler.json").read_text())
    del recorded["assembly"]["cases"]["mp2xpp2"]
    (partial / "assembler.json").write_text(json.dumps(recorded))
    proc = _run_bench("export_ranks.py", partial)
    assert proc.returncode != 0 and "has no ['assembly']['cases']['mp2xpp2']" in proc.stderr, proc.stderr[-3000:]
    for script in ("lora_merge.py", "convert.py"):
        proc = _run_bench(script, tmp_path / "before", "--before", str(tmp_path / "no-such-tree"))
        assert proc.returncode != 0 and "is not a checkout of this package" in proc.stderr, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("*.json")) or {p.name for p in tmp_path.rglob("*.json")} == {"assembler.json"}


def test_the_scaling_model_reads_the_assemblers_json(tmp_path):
    """bench/export_ranks.py's model, from the recorded JSONs: this machine's rates are the assembler's and the
    single-process benchmark's figures (none of the old built-in 0.45 / 0.12 GB/s)."""
    results = tmp_path / "r"
    results.mkdir()
    for name in ("assembler.json", "export_single.json", "export_ranks.json"):
        (results / name).write_bytes((RECORDED / name).read_bytes())
    proc = _run_bench("export_ranks.py", results, "--model-only", "--result", str(results / "export_ranks.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = json.loads((results / "export_ranks.json").read_text())["scaling_model"]
    asm = json.loads((RECORDED / "assembler.json").read_text())["assembly"]["cases"]["mp2xpp2"]["variants"]["routed"]
    rate = max(r["kernel_received"] for r in asm["per_rank"].values()) / 1e9 / asm["median_seconds"]
    assert model["measured_inputs"]["assembly_gb_s_per_rank"]["routed"] == pytest.approx(rate, rel=1e-3)
    assert model["bytes"]["ours_mp8xpp8"]["inter_bytes"] == 0.0  # routed: pipeline stages never cross nodes


def test_a_tiny_runs_slow_assembly_rate_is_kept_not_rounded_to_zero(tmp_path):
    """A tiny run moves a few kB in tenths of a second: its rate (~1e-5 GB/s) stays a rate, and the model runs on it
    (it once rounded to 0.000 GB/s and the model divided by it)."""
    results = tmp_path / "r"
    results.mkdir()
    for name in ("assembler.json", "export_single.json", "export_ranks.json"):
        (results / name).write_bytes((RECORDED / name).read_bytes())
    asm = json.loads((results / "assembler.json").read_text())
    for variant in asm["assembly"]["cases"]["mp2xpp2"]["variants"].values():
        variant["median_seconds"] *= 1e4
    (results / "assembler.json").write_text(json.dumps(asm))
    proc = _run_bench("export_ranks.py", results, "--model-only", "--result", str(results / "export_ranks.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = json.loads((results / "export_ranks.json").read_text())["scaling_model"]
    assert 0 < model["measured_inputs"]["assembly_gb_s_per_rank"]["routed"] < 1e-3


def test_real_size_names_what_a_run_lacks_before_writing(tmp_path):
    """bench/real_size.py (issue 47) checks memory and disk before it writes anything, from the model's size: the
    7.6 B run's needs, and one line naming each figure that is short."""
    sys.path.insert(0, str(BENCH))
    import _real_size as R

    full = R.needs(R.dims("full"))
    assert R.model_bytes(R.dims("full")) == 7_615_487_488 * 2 and len(R.shapes(R.dims("full"))) == 255
    assert 19e9 < full["memory_bytes"] < 20e9 and 32e9 < full["disk_bytes"] < 33e9
    plenty = {"mem_available_bytes": 10**12, "disk_free_bytes": 10**13, "disk_dir": str(tmp_path)}
    assert R.missing(full, plenty) is None
    short = R.missing(full, dict(plenty, mem_available_bytes=8 * 10**9, disk_free_bytes=20 * 10**9))
    assert "\n" not in short and "memory: needs 19.4 GB available, MemAvailable is 8.0 GB" in short
    assert f"disk: needs 32.5 GB free in {tmp_path}, 20.0 GB free" in short
    # save_pretrained holds 2x the model beside it: at 7.6 B it runs at fewer layers of the same widths
    assert 0 < R.pf_layers_that_fit(R.dims("full"), 22 * 10**9) < 28 == R.pf_layers_that_fit(R.dims("full"), 10**12)
