"""Every bundled recipe, run by ``paddle-fullparam demo`` as a user runs it, does what its description
(README's recipe table) promises: checked on the demo's real output (the printed table, the snapshots,
their manifests and safetensors headers, the ``latest``/``best`` pointers, ``verify_snapshot``).

A new recipe needs its row in ``EXPECT`` (the test of a recipe without one fails), a removed recipe
its row taken out. The demo's trainer saves every ``steps // 2`` steps and, for recipes that evaluate,
evaluates every ``steps // 4`` steps (``cli/demo.py``); the steps below are chosen with that in mind.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from paddle_fullparam_callbacks import verify_snapshot
from paddle_fullparam_callbacks.config.recipes import list_recipes, load_config
from paddle_fullparam_callbacks.config.schema import ConfigError

from _helpers import listing, run_cli

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow]

MANIFEST = "fullparam_manifest.json"


# ---- reading the demo's output ---------------------------------------------------------------
@dataclass
class Row:
    name: str
    step: int
    reason: str
    files: int
    bytes: int
    seconds: float
    stall_s: float
    metric: Optional[float]
    status: str


@dataclass
class DemoRun:
    out: Path
    stdout: str
    rows: List[Row]
    metric: Optional[str]  # the metric column of the table, if any
    stderr: str = ""

    @property
    def snaps(self) -> Path:
        return self.out / "snapshots"

    @property
    def trainer(self) -> Path:
        return self.out / "trainer"

    def line(self, prefix: str) -> Optional[str]:
        return next((ln for ln in self.stdout.splitlines() if ln.startswith(prefix)), None)

    def kept(self) -> List[Row]:
        return [r for r in self.rows if not r.status.startswith("removed")]


def parse_table(stdout: str) -> tuple:
    lines = stdout.splitlines()
    h = next(i for i, ln in enumerate(lines) if ln.startswith("snapshot ") and ln.rstrip().endswith("verify"))
    cols = lines[h].split()
    assert cols[:7] == ["snapshot", "step", "reason", "files", "bytes", "seconds", "stall_s"], cols
    metric = cols[7] if len(cols) == 9 else None
    assert set(lines[h + 1]) == {"-"}
    rows = []
    for ln in lines[h + 2:]:
        cells = ln.split(None, len(cols) - 1)
        if len(cells) < len(cols) or not cells[1].isdigit():
            break
        m = None
        if metric is not None:
            m = None if cells[7] == "-" else float(cells[7])
        rows.append(Row(cells[0], int(cells[1]), cells[2], int(cells[3]), int(cells[4]), float(cells[5]),
                        float(cells[6]), m, cells[-1].strip()))
    return rows, metric


def run_demo_cli(out: Path, recipe: Optional[str], steps: Optional[int], overrides=()) -> DemoRun:
    args = ["demo", "--output-dir", str(out)]
    if recipe is not None:
        args += ["--recipe", recipe]
    if steps is not None:
        args += ["--steps", str(steps)]
    proc = run_cli(*args, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows, metric = parse_table(proc.stdout)
    return DemoRun(out, proc.stdout, rows, metric, proc.stderr)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, read here (independently of the package's reader)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def shard_files(snapshot: Path) -> List[Path]:
    return sorted(snapshot.glob("*.safetensors"))


def tensor_dtypes(snapshot: Path) -> set:
    return {e["dtype"] for f in shard_files(snapshot) for k, e in safetensors_header(f).items() if k != "__metadata__"}


def manifest(snapshot: Path) -> dict:
    return json.loads((snapshot / MANIFEST).read_text())


def check_common(run: DemoRun, where: Callable[[Row], Path]) -> None:
    """For every recipe: each snapshot the table lists as kept exists, verifies (verify_snapshot and the
    table's own column), and its manifest and shards agree with its row; the others are gone."""
    assert run.rows, run.stdout
    assert [r.step for r in run.rows] == sorted({r.step for r in run.rows}), "one snapshot per step, in order"
    for r in run.rows:
        path = where(r)
        if r.status.startswith("removed"):
            assert not path.exists(), path
            continue
        assert r.status.split()[0] == "ok", r
        report = verify_snapshot(path)
        assert report.ok, report.errors
        m = manifest(path)
        assert (m["step"], m["reason"]) == (r.step, r.reason)
        assert r.files == len(shard_files(path))
        assert r.bytes == sum(f.stat().st_size for f in shard_files(path))
        assert r.stall_s <= r.seconds + 1e-4
    assert "export error" not in run.stdout


def in_snapshots(run: DemoRun) -> Callable[[Row], Path]:
    return lambda r: run.snaps / r.name


def check_snapshot_dir(run: DemoRun, kept: List[str], pointers=("latest",)) -> None:
    """``snapshots/`` holds exactly the kept snapshots and the pointers (nothing left behind)."""
    assert listing(run.snaps) == sorted([*kept, *pointers])
    assert [r.name for r in run.kept()] == kept
    latest = (run.snaps / "latest").read_text().strip()
    assert latest == run.rows[-1].name and run.line("latest -> ") == f"latest -> {latest}"
    assert "ok (latest" in next(r.status for r in run.rows if r.name == latest)


def name(step: int) -> str:
    return f"hf-step-{step:06d}"


# ---- what each recipe promises --------------------------------------------------------------
def check_demo_tiny_llama(run: DemoRun) -> None:
    # "every 10 steps, on save and at the end, small shards, keep 3": 25 steps, the trainer saves at
    # 12 and 24; the end (25) is not a multiple of 10 nor a save step
    cfg = load_config("demo_tiny_llama")
    assert (cfg.trigger.every_n_steps, cfg.trigger.on_save, cfg.trigger.on_train_end) == (10, True, True)
    assert (cfg.export.max_shard_bytes, cfg.retention.keep_last, cfg.export.dtype) == (200_000, 3, "keep")
    check_common(run, in_snapshots(run))
    assert [(r.step, r.reason) for r in run.rows] == [
        (10, "every_n_steps"), (12, "save"), (20, "every_n_steps"), (24, "save"), (25, "train_end")]
    check_snapshot_dir(run, [name(20), name(24), name(25)])
    for r in run.kept():
        snap = run.snaps / r.name
        shards = shard_files(snap)
        assert len(shards) > 1 and (snap / "model.safetensors.index.json").is_file()  # small shards: several
        for f in shards:
            header = safetensors_header(f)
            data = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
            assert data <= 200_000, (f.name, data)
        assert tensor_dtypes(snap) == {"F32"} and manifest(snap)["dtype"] == "keep"


def check_hf_every_n_steps(run: DemoRun) -> None:
    # "every 500 steps and at the end, bf16, 5GB shards, keep 5", scaled: every 5 steps of 30
    cfg = load_config("hf_every_n_steps")
    assert (cfg.trigger.every_n_steps, cfg.trigger.on_save, cfg.trigger.on_train_end) == (500, False, True)
    assert (cfg.export.dtype, cfg.export.max_shard_bytes, cfg.retention.keep_last) == ("bfloat16", 5 * 10**9, 5)
    check_common(run, in_snapshots(run))
    # on_save is off: the trainer's saves at 15 and 30 make no snapshot; the end (30) was just exported
    assert [(r.step, r.reason) for r in run.rows] == [(s, "every_n_steps") for s in (5, 10, 15, 20, 25, 30)]
    check_snapshot_dir(run, [name(s) for s in (10, 15, 20, 25, 30)])
    for r in run.kept():
        snap = run.snaps / r.name
        # 5GB shards: the whole model in one file, written as transformers writes it (no index)
        assert [f.name for f in shard_files(snap)] == ["model.safetensors"]
        assert not (snap / "model.safetensors.index.json").exists()
        assert tensor_dtypes(snap) == {"BF16"} and manifest(snap)["dtype"] == "bfloat16"


def check_hf_end_only(run: DemoRun) -> None:
    # unscaled, the demo says why only the end is exported
    assert run.line("note: trigger.every_n_steps=500 is more than the 8 steps") is not None, run.stdout
    assert [(r.step, r.reason) for r in run.rows] == [(8, "train_end")]


def check_eval_best(run: DemoRun) -> None:
    # "after each evaluation; track eval_loss, keep the 2 best and the newest, best pointer"
    cfg = load_config("eval_best")
    assert cfg.trigger.on_evaluate and not cfg.trigger.on_save and cfg.trigger.every_n_steps is None
    r = cfg.retention
    assert (r.metric, r.mode, r.keep_best, r.keep_last) == ("eval_loss", "min", 2, 1)
    first = run.line("demo: recipe eval_best, 20 steps, evaluation every 5 steps on ")
    assert first is not None and first.endswith(" held-out windows"), run.stdout
    assert run.line("training text: ") is not None, run.stdout  # the demo trains on its text, with its tokenizer
    check_common(run, in_snapshots(run))
    assert run.metric == "eval_loss"
    # an evaluation every 5 steps, a snapshot after each (the one at the end is that of step 20)
    assert [(x.step, x.reason) for x in run.rows] == [(s, "evaluate") for s in (5, 10, 15, 20)]
    losses = {x.name: x.metric for x in run.rows}
    assert all(v is not None and v > 0 for v in losses.values()), losses
    lowest = sorted(losses, key=losses.get)
    expect_kept = sorted(set(lowest[:2]) | {name(20)})
    check_snapshot_dir(run, expect_kept, pointers=("best", "latest"))
    best = (run.snaps / "best").read_text().strip()
    assert best == lowest[0]
    assert run.line("best -> ").startswith(f"best -> {best} (eval_loss {losses[best]:.6f}: the lowest of 4 snapshots")
    assert "best" in next(x.status for x in run.rows if x.name == best)
    for x in run.kept():  # the manifests hold the evaluation's metrics: the table's value is theirs
        m = manifest(run.snaps / x.name)
        assert m["metrics"]["eval_loss"] == pytest.approx(x.metric, abs=1e-6)
    assert min(manifest(run.snaps / n)["metrics"]["eval_loss"] for n in expect_kept) == \
        manifest(run.snaps / best)["metrics"]["eval_loss"]


def check_checkpoint_hook(run: DemoRun) -> None:
    # "with attach(): each checkpoint-N/ also holds its snapshot in hf/": the trainer saves at 10 and 20
    cfg = load_config("checkpoint_hook")
    assert cfg.checkpoint_hook.enabled and cfg.checkpoint_hook.subdir == "hf"
    assert (cfg.trigger.on_save, cfg.trigger.on_train_end, cfg.trigger.every_n_steps) == (True, False, None)
    check_common(run, lambda r: run.trainer / r.name)
    assert [(r.name, r.step, r.reason) for r in run.rows] == [
        ("checkpoint-10/hf", 10, "checkpoint"), ("checkpoint-20/hf", 20, "checkpoint")]
    assert sorted(p for p in os.listdir(run.trainer) if p.startswith("checkpoint-")) == ["checkpoint-10", "checkpoint-20"]
    for step in (10, 20):
        ckpt = run.trainer / f"checkpoint-{step}"
        assert set(os.listdir(ckpt)) - {"hf"}, "the trainer's own checkpoint files are next to hf/"
        assert not [p for p in os.listdir(ckpt) if p.startswith(".tmp-")]
        assert manifest(ckpt / "hf")["step"] == step and tensor_dtypes(ckpt / "hf") == {"F32"}
    # no second copy from on_save, nothing at the end, no pointer
    assert not run.snaps.exists() or listing(run.snaps) == []
    assert run.line("latest -> ") is None


def check_async_every_n_steps(run: DemoRun) -> None:
    # "every 100 steps, bytes written in the background from a ring that holds the rank's bytes", scaled: every 5 of 20
    cfg = load_config("async_every_n_steps")
    assert cfg.export.async_write and cfg.export.max_pending_auto
    assert (cfg.trigger.every_n_steps, cfg.trigger.on_save, cfg.trigger.on_train_end) == (100, False, True)
    assert cfg.retention.keep_last == 3
    check_common(run, in_snapshots(run))
    assert [(r.step, r.reason) for r in run.rows] == [(s, "every_n_steps") for s in (5, 10, 15, 20)]
    check_snapshot_dir(run, [name(s) for s in (10, 15, 20)])
    # background writes: training waited for the assembly only, less than each export took
    for r in run.rows:
        assert r.stall_s < r.seconds, r
    line = run.line("background writes (export.async_write, export.max_pending_bytes=auto): training waited ")
    assert line is not None, run.stdout
    # the stall of each export went through trainer.log (fullparam/stall_s), as a training metric
    logged = run.line("training stall logged through trainer.log as fullparam/stall_s: ")
    assert logged is not None, run.stdout
    assert [float(x) for x in logged.split(": ", 1)[1].split(", ")] == pytest.approx([r.stall_s for r in run.rows], abs=2e-4)


def check_evaluate_each_snapshot(run: DemoRun) -> None:
    # "each snapshot scored while training goes on: perplexity on held-out text (bundled evaluator, HF env);
    # best follows it": every 10 steps of 30, each snapshot evaluated by the real perplexity evaluator
    cfg = load_config("evaluate_each_snapshot")
    e, r = cfg.evaluate, cfg.retention
    assert e.command == "{python} -m paddle_fullparam_callbacks.consumers.evaluate.perplexity {snapshot} --output {output}"
    assert (e.python, e.every, e.last, e.max_concurrent) == ("$PFC_HF_PYTHON", 1, True, 1)
    assert (r.metric, r.mode, r.keep_best, r.keep_last) == ("evaluate.perplexity", "min", 2, 1)
    assert run.line("demo: recipe evaluate_each_snapshot, 30 steps") == "demo: recipe evaluate_each_snapshot, 30 steps"
    assert "evaluation every" not in run.stdout  # the trainer's own evaluations are off: the hook scores each snapshot
    check_common(run, in_snapshots(run))
    assert run.metric == "evaluate.perplexity"
    assert [(x.step, x.reason) for x in run.rows] == [(s, "every_n_steps") for s in (10, 20, 30)]
    ppl = {x.name: x.metric for x in run.rows}
    assert all(v is not None and 1 < v < 512 for v in ppl.values()), ppl  # better than uniform over 512 tokens
    for x in run.rows:  # the line under the table says the same, from the evaluator's own record
        assert run.line(f"evaluation of {x.name}: ok, perplexity {x.metric:.4f}, nll ") is not None, run.stdout
    logged = run.line("scores logged through trainer.log as fullparam/eval/perplexity (value@snapshot step): ")
    assert logged.split(": ", 1)[1] == ", ".join(f"{ppl[name(s)]:.4f}@{s}" for s in (10, 20, 30))
    lowest = sorted(ppl, key=ppl.get)
    expect_kept = sorted(set(lowest[:2]) | {name(30)})
    check_snapshot_dir(run, expect_kept, pointers=("best", "latest"))
    best = (run.snaps / "best").read_text().strip()
    assert best == lowest[0] and run.line("best -> ").startswith(
        f"best -> {best} (evaluate.perplexity {ppl[best]:.6f}: the lowest of 3 snapshots, 3 evaluations)")
    for n in expect_kept:
        snap = run.snaps / n
        record = json.loads((snap / "fullparam_evaluation.json").read_text())
        assert record["status"] == "ok" and record["scores"]["perplexity"] == pytest.approx(ppl[n], abs=1e-6)
        scores = record["scores"]
        assert scores["perplexity"] == pytest.approx(math.exp(scores["nll"])) and scores["tokens"] == 356
        assert record["result"]["text"].endswith("cli/demo_data/heldout.txt")
        assert sorted(p.name for p in snap.iterdir() if p.name.startswith(("fullparam_", ".fullparam"))) == [
            "fullparam_eval.log", "fullparam_evaluation.json", "fullparam_manifest.json"]


def check_lm_eval_each_snapshot(run: DemoRun) -> None:
    # "each snapshot scored by lm-evaluation-harness on the bundled local task pair (transformers, HF env) while
    # training goes on; best follows pfc_choice's acc_norm": every 10 steps of 20, the real harness, offline
    cfg = load_config("lm_eval_each_snapshot")
    e, r = cfg.evaluate, cfg.retention
    assert (e.command, e.callable, e.python) == (None, None, "$PFC_HF_PYTHON")
    assert (e.lm_eval.tasks, e.lm_eval.backend, e.lm_eval.include_path) == (["pfc_choice", "pfc_generate"], "hf", None)
    assert (r.metric, r.mode, r.keep_best, r.keep_last) == ("evaluate.lm_eval.pfc_choice.acc_norm", "max", 1, 1)
    check_common(run, in_snapshots(run))
    assert run.metric == "evaluate.lm_eval.pfc_choice.acc_norm"
    assert [(x.step, x.reason) for x in run.rows] == [(s, "every_n_steps") for s in (10, 20)]
    acc = {x.name: x.metric for x in run.rows}
    assert all(v is not None and round(v * 24, 4) == round(v * 24) for v in acc.values()), acc  # 24 documents
    for x in run.rows:
        assert run.line(f"evaluation of {x.name}: ok, lm_eval.pfc_choice.acc ") is not None, run.stdout
    best = (run.snaps / "best").read_text().strip()
    assert acc[best] == max(acc.values()) and run.line("best -> ").startswith(
        f"best -> {best} (evaluate.lm_eval.pfc_choice.acc_norm {acc[best]:.6f}: the highest of 2 snapshots, 2 evaluations)")
    expect_kept = sorted({best, name(20)})
    check_snapshot_dir(run, expect_kept, pointers=("best", "latest"))
    for n in expect_kept:
        snap = run.snaps / n
        record = json.loads((snap / "fullparam_evaluation.json").read_text())
        assert record["status"] == "ok" and record["scores"]["lm_eval.pfc_choice.acc_norm"] == pytest.approx(acc[n], abs=1e-6)
        assert 0 <= record["scores"]["lm_eval.pfc_generate.exact_match,strict-match"] <= 1
        raw = json.loads((snap / "fullparam_lm_eval.json").read_text())  # the harness's own results, beside the record
        assert raw["results"]["pfc_choice"]["acc_norm,none"] == record["scores"]["lm_eval.pfc_choice.acc_norm"]
        assert raw["n-samples"]["pfc_generate"]["effective"] == 16 and "samples" not in raw
        assert sorted(p.name for p in snap.iterdir() if p.name.startswith(("fullparam_", ".fullparam"))) == [
            "fullparam_eval.log", "fullparam_evaluation.json", "fullparam_lm_eval.json", "fullparam_manifest.json"]


@dataclass
class Expect:
    steps: int
    check: Callable[[DemoRun], None]
    overrides: List[str] = field(default_factory=list)


EXPECT: Dict[str, Expect] = {
    "demo_tiny_llama": Expect(25, check_demo_tiny_llama),
    "hf_every_n_steps": Expect(30, check_hf_every_n_steps, ["trigger.every_n_steps=5"]),
    "eval_best": Expect(20, check_eval_best),
    "checkpoint_hook": Expect(20, check_checkpoint_hook),
    "async_every_n_steps": Expect(20, check_async_every_n_steps, ["trigger.every_n_steps=5"]),
    "evaluate_each_snapshot": Expect(30, check_evaluate_each_snapshot),
    # evaluate.nice=0: beside the suite's other worker a nice-10 evaluator importing torch waits minutes for a core
    "lm_eval_each_snapshot": Expect(20, check_lm_eval_each_snapshot, ["evaluate.nice=0"]),
}

BUNDLED = [n for n, _ in list_recipes()]


@pytest.mark.parametrize("recipe", BUNDLED)
def test_bundled_recipe_in_the_demo(recipe, tmp_path, request, monkeypatch):
    if recipe not in EXPECT:
        pytest.fail(f"bundled recipe {recipe!r} has no expectation in tests/test_pf_recipes_demo.py EXPECT: add what "
                    "its description promises, checked on the demo's output")
    if load_config(recipe).evaluate.python == "$PFC_HF_PYTHON" and not os.environ.get("PFC_HF_PYTHON"):
        monkeypatch.setenv("PFC_HF_PYTHON", request.getfixturevalue("hf_python"))  # as `make demo` does
    e = EXPECT[recipe]
    run = run_demo_cli(tmp_path / "demo", recipe, e.steps, e.overrides)
    e.check(run)


def test_expectations_are_for_bundled_recipes():
    assert sorted(EXPECT) == sorted(BUNDLED), "EXPECT names a recipe that is not bundled (or misses one)"
    descriptions = dict(list_recipes())
    assert all(descriptions[n] for n in BUNDLED), "each recipe starts with a description comment"


def test_make_demo_twice_and_unscaled_triggers(tmp_path):
    # `make demo` with its defaults (demo_tiny_llama, 40 steps), run twice in the same place: the second
    # run replaces the first demo's output instead of meeting another run's snapshots
    out = tmp_path / "demo_output"
    first = run_demo_cli(out, None, None)
    assert [(r.step, r.reason) for r in first.rows] == [(s, "every_n_steps") for s in (10, 20, 30, 40)]
    # a quiet demo: its own lines and its table; none of the frameworks' notices (import-time warnings,
    # PaddleFormers' and Paddle's INFO lines, Paddle's empty-state-dict UserWarning)
    ours = ("INFO paddle_fullparam_callbacks:", "WARNING paddle_fullparam_callbacks:")
    assert [ln for ln in first.stderr.splitlines() if ln.strip() and not ln.startswith(ours)] == [], first.stderr
    assert not [ln for ln in first.stdout.splitlines() if "Warning" in ln or ln.startswith("[20")], first.stdout
    check_snapshot_dir(first, [name(s) for s in (20, 30, 40)])
    run1 = manifest(out / "snapshots" / name(40))["run"]["id"]
    second = run_demo_cli(out, None, None)
    assert second.line(f"removed the previous demo's snapshots/, trainer/ in {out.resolve()}") is not None
    check_common(second, in_snapshots(second))
    check_snapshot_dir(second, [name(s) for s in (20, 30, 40)])
    assert manifest(out / "snapshots" / name(40))["run"]["id"] != run1
    # an output directory the demo did not make is refused before training
    other = tmp_path / "mine"
    (other / "snapshots").mkdir(parents=True)
    (other / "snapshots" / "keep.txt").write_text("x")
    proc = run_cli("demo", "--output-dir", str(other), "--steps", "2")
    assert proc.returncode != 0 and "--output-dir" in proc.stderr and "not made by this demo" in proc.stderr
    assert listing(other) == ["snapshots"] and listing(other / "snapshots") == ["keep.txt"]
    # a recipe's every_n_steps beyond the demo's steps: the demo says so
    check_hf_end_only(run_demo_cli(tmp_path / "hf", "hf_every_n_steps", 8))


@pytest.mark.parametrize("steps", [0, -3])
def test_steps_below_one_is_an_error(steps, tmp_path):
    from paddle_fullparam_callbacks.cli.demo import run_demo

    out = tmp_path / "demo"
    with pytest.raises(ConfigError, match=rf"^--steps: must be a whole number >= 1 \(the demo's training steps\); got {steps}$"):
        run_demo(output_dir=str(out), steps=steps)
    assert not out.exists()
    proc = run_cli("demo", "--output-dir", str(out), "--steps", str(steps))
    assert proc.returncode != 0 and "--steps" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists() and "hf-step" not in proc.stdout


@pytest.mark.parametrize("steps", [True, 2.5, "3", None])
def test_steps_must_be_a_whole_number(steps, tmp_path):
    from paddle_fullparam_callbacks.cli.demo import run_demo

    with pytest.raises(ValueError, match=r"^--steps: must be a whole number >= 1"):
        run_demo(output_dir=str(tmp_path / "demo"), steps=steps)
    assert not (tmp_path / "demo").exists()
