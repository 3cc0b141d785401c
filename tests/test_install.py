"""The project as a user installs it, and each checkout testing its own code.

* requirements/*.txt carry pyproject.toml's constraints (``scripts/sync_requirements.py --check``), and
  the check catches a drift.
* ``python -m build`` makes an sdist and, from it, a wheel; both carry the recipes. The wheel goes
  non-editable into a fresh venv whose third-party packages are pip's own resolution of
  ``"<wheel>[cpu,paddleformers]"`` (made once per hash of the wheel's requirements, see
  tests/install/wheel_env.py); from a folder outside the checkout, with nothing on PYTHONPATH:
  ``paddle-fullparam recipes``, the PaddleFormers Trainer import, ``from_recipe``,
  ``paddle-fullparam demo --steps 20``, ``paddle-fullparam verify`` of every snapshot it made, and
  ``paddle-fullparam convert`` of the demo trainer's checkpoint-20 (the demo's own snapshot, file for file).
* The wheel's startup hook (``paddle_fullparam_callbacks.pth`` at its top level): with the wheel alone in a
  fresh venv, ``PADDLE_FULLPARAM_*`` variables switch snapshots on for ``paddleformers-cli train`` (LoRA, 4
  steps, a snapshot every 2, loaded by transformers with its tokenizer), nothing else set; without
  ``PADDLE_FULLPARAM_RECIPE`` the hook loads nothing; ``paddle-fullparam run`` leaves PYTHONPATH alone.
* Without ``[cpu]`` (a GPU cluster that installed paddlepaddle-gpu first), ``[paddleformers]`` and
  ``[paddlenlp]`` do not pull the CPU ``paddlepaddle`` wheel.
* Two copies of the checkout run their tests through their own Makefile at the same time on the same
  shared environment, each importing its own code in pytest, in subprocesses and in launched ranks;
  an editable install of another checkout in the environment does not win over PYTHONPATH.

Runs in make test's PaddleFormers pass (the PaddleNLP pass leaves this file out).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "install"))

import wheel_env as W  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PTH = ROOT / "paddle_fullparam_callbacks" / "trainer" / "autoattach" / "paddle_fullparam_callbacks.pth"
RECIPES = sorted(p.name for p in (ROOT / "paddle_fullparam_callbacks" / "recipes").glob("*.yaml"))
EXTRAS = ["cpu", "paddleformers"]
TIMINGS: dict = {}


# ---- one source of truth for the constraints ----------------------------------------------------
def test_requirements_agree_with_pyproject():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_requirements.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_requirements_drift_is_caught(tmp_path):
    for rel in ("pyproject.toml", "scripts/sync_requirements.py", *(f"requirements/{p.name}" for p in (ROOT / "requirements").glob("*.txt"))):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    script = [sys.executable, str(tmp_path / "scripts" / "sync_requirements.py")]
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    assert '"pyarrow<17"]' in text
    pyproject.write_text(text.replace('"pyarrow<17"]', '"pyarrow<18"]', 1))  # the [paddleformers] extra
    proc = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "+pyarrow<18" in proc.stderr and "requirements/paddleformers.txt" in proc.stderr, proc.stderr
    assert "run `make requirements`" in proc.stderr
    subprocess.run(script, check=True, capture_output=True)
    assert "pyarrow<18" in (tmp_path / "requirements" / "paddleformers.txt").read_text()
    assert subprocess.run([*script, "--check"], capture_output=True).returncode == 0
    # a range written by hand above the generated part is refused: users would not get it
    pins = tmp_path / "requirements" / "paddlenlp.txt"
    pins.write_text(pins.read_text().replace("paddlenlp==2.8.1\n", "paddlenlp==2.8.1\nnumpy<2\n"))
    proc = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert proc.returncode == 1 and "'numpy<2' above the pyproject.toml line" in proc.stderr, proc.stderr


# ---- the wheel, as a user installs it ------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel) of a copy of this checkout (a clone's files), built as a user builds them."""
    t0 = time.perf_counter()
    src = W.copy_checkout(tmp_path_factory.mktemp("clone"))
    sdist, wheel = W.build(src, tmp_path_factory.mktemp("dist"))
    TIMINGS["build_s"] = round(time.perf_counter() - t0, 1)
    return sdist, wheel


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """(python of a fresh venv holding the wheel, the deps venv)."""
    _, wheel = built
    t0 = time.perf_counter()
    deps, made = W.deps_env(wheel, EXTRAS, W.env_root())
    TIMINGS["deps_env_s" if made else "deps_env_cached_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    py = W.overlay_env(deps, tmp_path_factory.mktemp("venv") / "venv")
    W.install_wheel(py, wheel)
    TIMINGS["venv_and_wheel_s"] = round(time.perf_counter() - t0, 1)
    return py, deps


@pytest.mark.slow
@pytest.mark.paddleformers
def test_sdist_and_wheel_carry_the_recipes(built):
    sdist, wheel = built
    with zipfile.ZipFile(wheel) as z:
        in_wheel = sorted(n.rsplit("/", 1)[1] for n in z.namelist()
                          if re.fullmatch(r"paddle_fullparam_callbacks/recipes/[^/]+\.yaml", n))
    with tarfile.open(sdist) as t:
        in_sdist = sorted(n.rsplit("/", 1)[1] for n in t.getnames()
                          if re.fullmatch(r"[^/]+/paddle_fullparam_callbacks/recipes/[^/]+\.yaml", n))
    assert RECIPES and in_wheel == RECIPES and in_sdist == RECIPES
    # the demo's tokenizer, every file of it (tokenizer.model too: what llama.cpp's converter reads)
    tok = "paddle_fullparam_callbacks/cli/demo_data/tokenizer/"
    shipped = sorted(p.name for p in (ROOT / tok).iterdir())
    with zipfile.ZipFile(wheel) as z:
        assert sorted(n[len(tok):] for n in z.namelist() if n.startswith(tok)) == shipped
    with tarfile.open(sdist) as t:
        assert sorted(n.split(tok, 1)[1] for n in t.getnames() if tok in n and not n.endswith("/tokenizer")) == shipped
    # the startup hook's one line, at the wheel's top level where site.py reads .pth files, as written in the source
    with zipfile.ZipFile(wheel) as z:
        assert z.read("paddle_fullparam_callbacks.pth") == PTH.read_bytes()
        record = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    assert "\npaddle_fullparam_callbacks.pth," in "\n" + record  # pip uninstall removes it with the package
    # a clone keeps the top-level recipes/ for people who look there: the same files
    assert sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")) == RECIPES


@pytest.mark.slow
@pytest.mark.paddleformers
def test_wheel_installed_outside_the_checkout(installed, tmp_path):
    py, deps = installed
    bindir = py.parent
    cli = bindir / "paddle-fullparam"
    env = W.clean_env()
    run = tmp_path / "elsewhere"
    run.mkdir()
    t0 = time.perf_counter()
    assert W.run([py, "-m", "pip", "check"], cwd=run, env=env).returncode == 0

    listed = W.run([cli, "recipes"], cwd=run, env=env).stdout
    assert sorted(ln.split()[0] + ".yaml" for ln in listed.splitlines() if ln.strip()) == RECIPES, listed

    code = ("from paddleformers.trainer import Trainer\n"
            "import paddle_fullparam_callbacks as m\n"
            "from paddle_fullparam_callbacks import FullParamExportCallback\n"
            "from paddle_fullparam_callbacks.config.recipes import recipes_dir\n"
            "cb = FullParamExportCallback.from_recipe('hf_every_n_steps')\n"
            "print('PROBE', m.__file__, recipes_dir())\n")
    out = W.run([py, "-c", code], cwd=run, env=env).stdout
    pkg_file, recipes = next(ln for ln in out.splitlines() if ln.startswith("PROBE ")).split()[1:]
    site = W.purelib(py)
    assert Path(pkg_file).parent == site / "paddle_fullparam_callbacks", out  # the wheel, not a checkout
    assert Path(recipes) == site / "paddle_fullparam_callbacks" / "recipes"

    demo = W.run([cli, "demo", "--steps", "20"], cwd=run, env=env, timeout=600)
    snapshots = sorted((run / "demo_output" / "snapshots").glob("hf-step-*"))
    assert [s.name for s in snapshots] == ["hf-step-000010", "hf-step-000020"], demo.stdout
    for snap in snapshots:
        proc = W.run([cli, "verify", "--json", snap], cwd=run, env=env, check=False)
        assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stdout + proc.stderr

    # convert the demo trainer's own checkpoint (flex: no config.json in it) with the installed command
    model_config = run / "model_config.json"
    W.run([py, "-c", "import json, sys; from paddle_fullparam_callbacks.cli.demo import TINY_LLAMA; "
           "json.dump(dict(TINY_LLAMA, fuse_rms_norm=False, architectures=['LlamaForCausalLM']), open(sys.argv[1], 'w'))",
           model_config], cwd=run, env=env)
    conv = W.run([cli, "convert", run / "demo_output" / "trainer" / "checkpoint-20", "--output-dir", run / "converted",
                  "--config", model_config, "--recipe", "demo_tiny_llama"], cwd=run, env=env, check=False, timeout=600)
    assert conv.returncode == 0, conv.stdout + conv.stderr
    manifests = [json.loads((d / "fullparam_manifest.json").read_text())
                 for d in (run / "converted" / "hf-step-000020", snapshots[-1])]
    shards = [{n: f for n, f in m["files"].items() if n.endswith(".safetensors")} for m in manifests]
    assert shards[0] and shards[0] == shards[1], shards  # the demo's own snapshot of step 20, file for file
    TIMINGS["run_s"] = round(time.perf_counter() - t0, 1)
    resolved = (deps / "resolved.txt").read_text()
    print(f"install test timings {TIMINGS}; resolved from the wheel's metadata: "
          + ", ".join(ln for ln in resolved.splitlines() if re.match(r"(paddle|numpy|pyarrow|datasets)", ln, re.IGNORECASE)))


@pytest.mark.slow
@pytest.mark.paddleformers
@pytest.mark.hf_client
def test_wheel_switches_snapshots_on_from_environment_variables(installed, tmp_path, hf_python):
    """The scheduler's form: the wheel in the venv, variables set, the framework's own command unchanged."""
    import socket

    from _helpers import use_snapshots

    py, deps = installed
    cli = py.parent / "paddle-fullparam"
    probe = ("import sys; print(sorted(m for m in ('_paddle_fullparam_startup', 'paddle_fullparam_callbacks', 'paddle', "
             "'numpy', 'omegaconf') if m in sys.modules), [type(f).__name__ for f in sys.meta_path][:1])")
    off = W.run([py, "-c", probe], cwd=tmp_path, env=W.clean_env()).stdout.split("]")[0]
    on = W.run([py, "-c", probe], cwd=tmp_path, env=W.clean_env(PADDLE_FULLPARAM_RECIPE="default")).stdout
    assert off == "[" and on.split() == ["['_paddle_fullparam_startup']", "['_TrainerModuleFinder']"], (off, on)
    # run from the wheel: its .pth does the work, COMMAND's PYTHONPATH is left as it was
    wrapped = W.run([cli, "run", "--", py, "-c", "import os; print(repr(os.environ.get('PYTHONPATH')))"], cwd=tmp_path,
                    env=W.clean_env())
    assert wrapped.stdout.strip() == "None" and "without ever building a PaddleFormers or PaddleNLP Trainer" in wrapped.stderr

    model, snaps_dir, data = tmp_path / "tiny-llama", tmp_path / "snaps", ROOT / "examples" / "paddleformers_cli" / "data"
    W.run([py, ROOT / "examples" / "make_tiny_llama.py", model], cwd=tmp_path, env=W.clean_env(), timeout=600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = W.clean_env(
        PATH=f"{py.parent}:{deps / 'bin'}:/usr/bin:/bin", CUDA_VISIBLE_DEVICES="0", MASTER_PORT=str(port),
        PADDLEFORMERS_DIST_LOG=str(tmp_path / "distlog"), PADDLE_FULLPARAM_RECIPE="hf_every_n_steps",
        PADDLE_FULLPARAM_OVERRIDES="trigger.every_n_steps=2 export.dtype=keep", PADDLE_FULLPARAM_OUTPUT_DIR=str(snaps_dir))
    proc = W.run([deps / "bin" / "paddleformers-cli", "train", ROOT / "examples" / "paddleformers_cli" / "sft_cpu.yaml",
                  f"model_name_or_path={model}", f"output_dir={tmp_path / 'out'}", "fine_tuning=LoRA",
                  f"train_dataset_path={data / 'sft_train.jsonl'}", f"eval_dataset_path={data / 'sft_eval.jsonl'}"],
                 cwd=tmp_path, env=env, timeout=900, check=False)
    rank_log = (tmp_path / "distlog" / "workerlog.0").read_text(errors="replace")
    assert proc.returncode == 0, proc.stderr[-3000:] + rank_log[-4000:]
    assert (tmp_path / "out" / "lora_config.json").is_file()
    hook = [ln for ln in rank_log.splitlines() if ln.startswith("[paddle-fullparam] ")]
    assert hook == ["[paddle-fullparam] SFTTrainer: FullParamExportCallback attached (recipe hf_every_n_steps, overrides "
                    f"trigger.every_n_steps=2 export.dtype=keep); snapshots in {snaps_dir}"], hook
    snaps = sorted(snaps_dir.glob("hf-step-*"))
    assert [s.name for s in snaps] == ["hf-step-000002", "hf-step-000004"]
    for snap in snaps:
        proc = W.run([cli, "verify", "--json", snap], cwd=tmp_path, env=W.clean_env(), check=False)
        assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stdout + proc.stderr
    used = use_snapshots(hf_python, *snaps)
    for snap in snaps:
        tf = used[str(snap)]["transformers"]
        assert tf["vocab"] == 512 and tf["missing_keys"] == tf["unexpected_keys"] == [] and len(tf["generated_ids"]) == 8


@pytest.mark.slow
@pytest.mark.paddleformers
@pytest.mark.parametrize("extra", ["paddleformers", "paddlenlp"])
def test_gpu_extras_do_not_pull_paddlepaddle(built, extra):
    """A GPU cluster installs paddlepaddle-gpu first, then asks for [paddleformers] or [paddlenlp] alone."""
    _, wheel = built
    names = W.resolve_names(wheel, [extra], W.env_root())
    assert extra in names and "paddlepaddle" not in names, names


# ---- two clones at once ------------------------------------------------------------------------
def _marked_copy(dst: Path, mark: str) -> Path:
    W.copy_checkout(dst)
    init = dst / "paddle_fullparam_callbacks" / "__init__.py"
    init.write_text(init.read_text() + f"\nCHECKOUT_MARK = {mark!r}\n")
    return dst


@pytest.mark.slow
@pytest.mark.paddleformers
def test_two_checkouts_each_test_their_own_code(tmp_path):
    if not shutil.which("make"):
        pytest.skip("make is not installed")
    copies = {m: _marked_copy(tmp_path / m, m) for m in ("A", "B")}
    probe = "tests/install/probe_checkout.py"
    # both at once, each through its own Makefile, on the same shared (cached) environments
    procs = {m: subprocess.Popen(["make", "-s", "-C", str(d), "test-paddleformers", f"TESTS={probe}",
                                  "PYTEST_ARGS=-q -p no:cacheprovider", "TEST_WORKERS=0"],
                                 env=W.clean_env(PFC_PROBE_OUT=str(tmp_path / f"{m}.json")),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for m, d in copies.items()}
    for m, p in procs.items():
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"copy {m}:\n{out[-4000:]}"
    for m, d in copies.items():
        report = json.loads((tmp_path / f"{m}.json").read_text())
        assert report["root"] == str(d)
        assert {k: v[1] for k, v in report["seen"].items()} == {"pytest": m, "subprocess": m, "launch": m}, report

    # an editable install of A left in the shared environment (a venv layered on it here, so that the
    # shared one stays untouched): B's tests, run as B's Makefile runs them, still import B everywhere
    stale = W.overlay_env(Path(sys.prefix), tmp_path / "stale-venv")
    W.run([stale, "-m", "pip", "install", "-q", "--no-deps", "-e", copies["A"]], timeout=600)
    before = W.run([stale, "-c", "import paddle_fullparam_callbacks as m; print(m.CHECKOUT_MARK)"], cwd=tmp_path).stdout
    assert before.split() == ["A"]  # without PYTHONPATH, the editable install is what every process imports
    W.run([stale, "-m", "pytest", probe, "-q", "-p", "no:cacheprovider"], cwd=copies["B"],
          env=W.clean_env(PYTHONPATH=str(copies["B"]), PFC_PROBE_OUT=str(tmp_path / "stale.json")), timeout=600)
    report = json.loads((tmp_path / "stale.json").read_text())
    assert {k: v[1] for k, v in report["seen"].items()} == {"pytest": "B", "subprocess": "B", "launch": "B"}, report
