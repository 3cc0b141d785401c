"""Expert parallelism on real ranks: experts held whole by different ranks, gathered from their owners.

Three launches (``tests/multirank/ep_job.py``), every case of a topology inside one launch:

- dp2: PaddleFormers' ``Ernie4_5_MoeForCausalLM`` with ``moe_group="dp"`` (the data-parallel ranks
  hold different experts: the data axis joins the mesh, one mesh of 2);
- mp2: the same model with ``moe_group="mp"`` (the tensor-parallel ranks hold different experts);
- dp2 x mp2: the model with ``moe_group="dp"`` (one mesh of 4: experts whole on a data rank and
  replicated across its mp pair, dense tensors split across mp) and with ``moe_group="mp"`` (two
  meshes, the mp rows: the dp replicas still split the work); and the harness's tensor-parallel
  Llama with per-rank experts over data and over model, two exports with deterministic
  "optimizer steps" between them.

Each rank holds only its own experts (``experts[i]`` None elsewhere). The real callback exports
through the trainer's callback handler; the plan it used (``session.ctx.topology``) is the one
expected, and the one ``paddle-fullparam plan`` prints. Every expert is in the snapshot exactly once,
from its owner, bit for bit: the Paddle-format export (Paddle names, no mapping) equals the full
tensors rebuilt with numpy from every rank's dumped shards (dense replicas checked equal across the
ranks that hold them), each expert equals its owner's dumped tensor, and the Hugging Face export's
experts are those tensors split and transposed. ``verify`` passes, and transformers' own loader
(``verify --transformers``, in the ``hf`` environment) builds ``Ernie4_5_MoeForCausalLM`` from each
snapshot's ``config.json`` with nothing missing, unexpected, mis-shaped or mis-typed (its forward needs
GPU kernels here, so names and shapes are what it checks). Several ranks write files of each snapshot.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multirank"))

import harness  # noqa: E402

from _helpers import run_cli, snapshot_tensors  # noqa: E402
from paddle_fullparam_callbacks import verify_snapshot  # noqa: E402
from paddle_fullparam_callbacks.export.write.header import read_header  # noqa: E402

pytestmark = [pytest.mark.paddleformers, pytest.mark.slow, pytest.mark.hf_client]

JOB = ROOT / "tests" / "multirank" / "ep_job.py"
LAUNCHES = {
    "dp2": dict(dp=2, mp=1, nproc=2, cases=["ernie-dp"]),
    "mp2": dict(dp=1, mp=2, nproc=2, cases=["ernie-mp"]),
    "dp2xmp2": dict(dp=2, mp=2, nproc=4, cases=["ernie-dp", "ernie-mp", "toy-dp", "toy-mp"]),
}
# (launch, case) -> the meshes' rows the callback must plan (one row each: no pipeline)
MESHES = {
    ("dp2", "ernie-dp"): [[0, 1]],
    ("mp2", "ernie-mp"): [[0, 1]],
    ("dp2xmp2", "ernie-dp"): [[0, 1, 2, 3]],  # experts over data: data joins the mp rows
    ("dp2xmp2", "ernie-mp"): [[0, 1], [2, 3]],  # experts over model: the dp replicas split the work
    ("dp2xmp2", "toy-dp"): [[0, 1, 2, 3]],
    ("dp2xmp2", "toy-mp"): [[0, 1], [2, 3]],
}
ERNIE = [(t, c) for t, c in MESHES if c.startswith("ernie")]
TOY = [(t, c) for t, c in MESHES if c.startswith("toy")]
NUM_EXPERTS = 4
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
TOY_TRANSPOSED = re.compile(r"(_proj\.weight|^lm_head\.weight|\.experts\.\d+\.weight)$")
TOY_STEPS = (1, 2)


def ids(pairs):
    return [f"{t}-{c}" for t, c in pairs]


@pytest.fixture(scope="module")
def ep(tmp_path_factory, hf_python):
    """The three launches and one transformers check of every Hugging Face snapshot, once per module."""
    root = tmp_path_factory.mktemp("ep")
    seconds, reports = {}, {}
    for name, t in LAUNCHES.items():
        res = harness.run_launch(JOB, ["--dp", t["dp"], "--mp", t["mp"], "--cases", ",".join(t["cases"]),
                                       "--out", root / name], nproc=t["nproc"], log_dir=root / f"log-{name}", timeout=300)
        seconds[f"launch {name}"] = round(res.seconds, 1)
        assert res.rc == 0 and not res.timed_out, res.describe()
        for _, r in res.tagged("EP"):
            reports.setdefault((name, r["case"]), []).append(r)
    snaps = sorted({s for (t, c) in ERNIE for r in reports.get((t, c), []) for x in ("hf", "fp8")
                    for s in r.get(x, {}).get("snapshots", [])})
    t0 = time.perf_counter()
    hf = {}
    if snaps:
        proc = subprocess.run([hf_python, "-m", "paddle_fullparam_callbacks", "verify", "--transformers", "--json", *snaps],
                              capture_output=True, text=True, timeout=300)
        assert proc.stdout.strip(), proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        hf = {s["path"]: s for s in (out["snapshots"] if "snapshots" in out else [out])}
    seconds["verify --transformers"] = round(time.perf_counter() - t0, 1)
    print("expert-parallel test timings (s):", json.dumps(seconds))
    return {"root": root, "reports": reports, "hf": hf, "seconds": seconds}


def case_reports(ep, topology, case):
    reps = sorted(ep["reports"].get((topology, case), []), key=lambda r: r["rank"])
    assert len(reps) == LAUNCHES[topology]["nproc"], f"{len(reps)} rank reports for {topology}/{case}"
    return reps


def owner(expert: int, moe_world: int) -> int:
    """The expert-axis index of the rank holding ``expert`` (PaddleFormers' contiguous placement)."""
    return expert // (NUM_EXPERTS // moe_world)


def moe_index(r: dict, case: str) -> int:
    return r["dp_rank"] if case.endswith("-dp") else r["mp_rank"]


def check_plan(reps, topology, case, export):
    """The plan the callback used (its context's topology) on every rank; each mesh wrote files."""
    rows = MESHES[(topology, case)]
    for r in reps:
        got = r[export]["topology"]
        assert got["num_splits"] == len(rows), got
        assert [m["h"] for m in got["meshes"]] == [[row] for row in rows], got["meshes"]
        assert r[export]["mesh"] == [next(row for row in rows if r["rank"] in row)]
        axis = "data" if case.endswith("-dp") else "model"  # the axis the experts are spread over
        assert axis in got["horizontal_axes"] and axis not in got["replica_axes"], got
        assert ("data" in got["replica_axes"]) == case.endswith("-mp"), got
    for step_index in range(len(reps[0][export]["files_written_here"])):
        writers = {r["rank"] for r in reps if r[export]["files_written_here"][step_index]}
        assert len(writers) >= 2, (export, writers)  # writers work in parallel
        assert all(writers & set(row) for row in rows), (writers, rows)  # replica meshes split the work


def dumps_by_rank(dump_dir: Path) -> dict:
    """{rank: {key: (meta, raw bytes)}} of every rank's dumped shards."""
    out = {}
    for f in sorted(dump_dir.glob("shards-rank*.npz")):
        rank = int(re.search(r"rank(\d+)", f.name).group(1))
        out[rank] = {m["key"]: (m, raw) for m, raw in harness.load_dump(f)}
    return out


def expert_counts(snapshot: Path) -> Counter:
    """How often each expert tensor name appears in the snapshot's files' headers."""
    c = Counter()
    for f in sorted(snapshot.glob("*.safetensors")):
        _, entries, _ = read_header(f)
        c.update(n for n in entries if EXPERT.match(n))
    return c


def check_experts_from_owners(got: dict, dumps: dict, reps, case, transposed: bool, moe_world: int = 2) -> int:
    """Each expert in ``got`` equals, bit for bit, the tensor dumped by its owners (and only they
    hold it: experts are whole, on the owning expert-axis index, replicated on the other axes)."""
    n = 0
    for name in sorted(k for k in got if EXPERT.match(k)):
        e = int(EXPERT.match(name).group(2))
        holders = sorted(rank for rank, d in dumps.items() if name in d)
        owners = sorted(r["rank"] for r in reps if moe_index(r, case) == owner(e, moe_world))
        assert holders == owners, (name, holders, owners)
        for rank in holders:
            meta, raw = dumps[rank][name]
            assert meta["global_shape"] == meta["local_shape"] and not any(meta["global_offset"]), meta  # whole
            want = raw.view(harness.np_storage_dtype(meta["dtype"])).reshape(meta["local_shape"])
            want = np.ascontiguousarray(want.T) if transposed else want
            assert got[name].shape == want.shape and got[name].tobytes() == want.tobytes(), f"{name} != rank {rank}'s"
        n += 1
    return n


# ----------------------------------------------------------------------------------------------
# PaddleFormers' Ernie4_5_Moe
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology, case", ERNIE, ids=ids(ERNIE))
def test_ernie_moe_ranks_hold_only_their_experts(ep, topology, case):
    reps = case_reports(ep, topology, case)
    for r in reps:
        assert "build_error" not in r, r["build_error"]
        assert r["values_set"], r
        assert r["expert_axes"] == (["data"] if case.endswith("-dp") else ["model"])
        assert r["moe_world_size"] == 2 and r["moe_rank"] == moe_index(r, case), r
        # every MoE layer (1 and 2 of the 3) holds the rank's two experts; None for the others
        mine = [e for e in range(NUM_EXPERTS) if owner(e, 2) == r["moe_rank"]]
        assert r["experts_held"] == {"1": mine, "2": mine}, r


@pytest.mark.parametrize("topology, case", ERNIE, ids=ids(ERNIE))
def test_ernie_moe_export_every_expert_once_bit_exact(ep, topology, case):
    reps = case_reports(ep, topology, case)
    for r in reps:
        assert "export_error" not in r, r["export_error"]
        for export in ("hf", "paddle"):
            assert r[export]["errors"] == [] and r[export]["events"] == ["every_n_steps@1"], r[export]
    for export in ("hf", "paddle"):
        check_plan(reps, topology, case, export)
    snap = {export: Path(reps[0][export]["snapshots"][0]) for export in ("hf", "paddle")}
    assert all(Path(r[x]["snapshots"][0]) == snap[x] for r in reps for x in snap)
    for s in snap.values():
        report = verify_snapshot(s)
        assert report.ok, report.errors

    # Paddle names, no mapping: the full tensors rebuilt from every rank's dumps (dense replicas
    # equal on every rank holding them), bit for bit; each expert from its owner(s) only
    case_dir = ep["root"] / topology / case
    rebuilt, count = harness.reassemble(case_dir / "dump", return_coverage=True)
    got = snapshot_tensors(snap["paddle"])
    assert set(got) == set(rebuilt), sorted(set(got) ^ set(rebuilt))
    for k, v in rebuilt.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
    dumps = dumps_by_rank(case_dir / "dump")
    world = len(reps)
    for k in rebuilt:
        if not EXPERT.match(k):  # dense: a shard or a replica on every rank
            assert sum(k in d for d in dumps.values()) == world, k
    assert check_experts_from_owners(got, dumps, reps, case, transposed=False) == 2 * NUM_EXPERTS * 2
    assert expert_counts(snap["paddle"]) == Counter({k: 1 for k in got if EXPERT.match(k)})

    # Hugging Face: every expert once, and it is the owner's fused tensor split and transposed
    hf = snapshot_tensors(snap["hf"])
    hf_experts = expert_counts(snap["hf"])
    assert len(hf_experts) == 2 * NUM_EXPERTS * 3 and set(hf_experts.values()) == {1}, hf_experts
    for layer in (1, 2):
        for e in range(NUM_EXPERTS):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            up_gate, down = got[p + "up_gate_proj.weight"], got[p + "down_proj.weight"]
            inter = down.shape[0]
            assert hf[p + "gate_proj.weight"].tobytes() == np.ascontiguousarray(up_gate[:, :inter].T).tobytes(), p
            assert hf[p + "up_proj.weight"].tobytes() == np.ascontiguousarray(up_gate[:, inter:].T).tobytes(), p
            assert hf[p + "down_proj.weight"].tobytes() == np.ascontiguousarray(down.T).tobytes(), p

    # transformers' own Ernie4_5_Moe, built from config.json, loads every tensor by name and shape
    v = ep["hf"][str(snap["hf"])]
    assert v["ok"], v
    t = v["transformers"]
    assert t["architecture"] == "Ernie4_5_MoeForCausalLM" and t["ok"], t
    assert t["missing"] == [] and t["unexpected"] == [] and t["mismatched"] == [] and t["wrong_dtype"] == [], t
    assert t["errors"] == [], t


@pytest.mark.parametrize("topology, case", ERNIE, ids=ids(ERNIE))
def test_ernie_moe_fp8_is_the_rule_applied_to_the_snapshot(ep, topology, case):
    """export.quantization=fp8 in the same launch: each expert quantized whole by its writer. Every quantized
    weight and its scale are the rule's (``tests/_fp8_reference.py``) on the Hugging Face snapshot's tensor (the
    test above proves that one the single-process snapshot), the other tensors that snapshot's; verify and
    transformers' loader (meta device) accept it."""
    from _fp8_reference import quantize

    reps = case_reports(ep, topology, case)
    assert all(r["fp8"]["errors"] == [] and r["fp8"]["events"] == ["every_n_steps@1"] for r in reps), reps
    snap, plain = Path(reps[0]["fp8"]["snapshots"][0]), Path(reps[0]["hf"]["snapshots"][0])
    assert verify_snapshot(snap).ok
    got, want = snapshot_tensors(snap), snapshot_tensors(plain)
    quantized = sorted(k for k in got if k + "_scale_inv" in got)
    assert len([k for k in quantized if EXPERT.match(k)]) == 2 * NUM_EXPERTS * 3
    assert set(got) == set(want) | {k + "_scale_inv" for k in quantized}
    for k, v in want.items():
        if k in quantized:
            q, inv = quantize(v, (16, 16))
            assert got[k].tobytes() == q.tobytes() and got[k + "_scale_inv"].tobytes() == inv.tobytes(), k
        else:
            assert got[k].tobytes() == v.tobytes(), k
    v = ep["hf"][str(snap)]
    assert v["ok"] and v["transformers"]["ok"], v


# ----------------------------------------------------------------------------------------------
# The harness's tensor-parallel Llama with per-rank experts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("topology, case", TOY, ids=ids(TOY))
def test_harness_experts_gathered_from_owners_bit_exact(ep, topology, case):
    reps = case_reports(ep, topology, case)
    layers = 4
    for r in reps:
        assert "export_error" not in r, r["export_error"]
        assert r["hf"]["errors"] == [] and r["hf"]["events"] == [f"every_n_steps@{s}" for s in TOY_STEPS], r["hf"]
        assert r["expert_axes"] == (["data"] if case.endswith("-dp") else ["model"])
        mine = [e for e in range(NUM_EXPERTS) if owner(e, 2) == moe_index(r, case)]
        assert r["experts_held"] == sorted(f"model.layers.{i}.mlp.experts.{e}.weight" for i in range(layers) for e in mine)
    check_plan(reps, topology, case, "hf")
    case_dir = ep["root"] / topology / case
    for step, snap in zip(TOY_STEPS, reps[0]["hf"]["snapshots"]):
        snap = Path(snap)
        report = verify_snapshot(snap)
        assert report.ok, report.errors
        got = snapshot_tensors(snap)
        dump = case_dir / "dump" / f"step-{step}"
        rebuilt = harness.reassemble(dump)
        expected = {k: np.ascontiguousarray(v.T) if TOY_TRANSPOSED.search(k) else v for k, v in rebuilt.items()}
        assert set(got) == set(expected), sorted(set(got) ^ set(expected))
        for k in expected:
            assert got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape, k
            assert got[k].tobytes() == expected[k].tobytes(), f"step {step}: {k} differs"
        # each expert: its owner's tensor, which is the step's deterministic value
        dumps = dumps_by_rank(dump)
        assert check_experts_from_owners(got, dumps, reps, case, transposed=True) == layers * NUM_EXPERTS
        for k in (k for k in got if EXPERT.match(k)):
            want = harness.expected_global(k, got[k].shape[::-1], step)
            assert got[k].tobytes() == np.ascontiguousarray(want.T).tobytes(), k
        assert set(expert_counts(snap).values()) == {1} and len(expert_counts(snap)) == layers * NUM_EXPERTS
        manifest = json.loads((snap / "fullparam_manifest.json").read_text())
        assert sorted(int(w) for w in manifest["topology"]["writers"]) == sorted(
            r["rank"] for r in reps if r["hf"]["files_written_here"][TOY_STEPS.index(step)])


# ----------------------------------------------------------------------------------------------
# paddle-fullparam plan shows the plan the jobs used
# ----------------------------------------------------------------------------------------------


def test_cli_plan_shows_what_the_jobs_used(ep):
    def plan(*args):
        proc = run_cli("plan", *args)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def used(topology, case):
        return case_reports(ep, topology, case)[0]["hf"]["topology"]

    for args, (topology, case) in (
        (["--dp", "2", "--mp", "2", "--experts-over", "data"], ("dp2xmp2", "ernie-dp")),
        (["--dp", "2", "--mp", "2", "--experts-over", "model"], ("dp2xmp2", "ernie-mp")),
        (["--dp", "2", "--experts-over", "data"], ("dp2", "ernie-dp")),
        (["--mp", "2"], ("mp2", "ernie-mp")),
    ):
        out = json.loads(plan(*args, "--json"))
        job = used(topology, case)
        assert out["meshes"] == job["meshes"] and out["num_splits"] == job["num_splits"], (args, out, job)
        assert out["world_size"] == job["world_size"]
    text = plan("--dp", "2", "--mp", "2", "--experts-over", "data")
    assert "1 mesh(es) split the export" in text, text
    assert "mesh 0: rows [[0, 1, 2, 3]]" in text, text
    # a dedicated expert axis: its ranks join the tensor-parallel rows, the data replicas split the work
    out = json.loads(plan("--ep", "2", "--dp", "2", "--mp", "2", "--json"))
    assert out["world_size"] == 8 and out["num_splits"] == 2, out
    assert [m["h"] for m in out["meshes"]] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]], out
    assert "expert" in out["horizontal_axes"] and "data" in out["replica_axes"], out
    text = plan("--ep", "2", "--dp", "2", "--mp", "2")
    assert "mesh rows (horizontal) over expert, model" in text and "replicas over data" in text, text
