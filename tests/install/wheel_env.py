"""Build this checkout's wheel and install it as a user would, cheaply on re-runs (used by tests/test_install.py).

* :func:`copy_checkout`: the files a clone would have (tracked, plus new files not ignored), symlinks kept.
* :func:`build`: ``python -m build``: the sdist, then the wheel built from that sdist (isolated builds).
* :func:`deps_env`: a venv holding the third-party packages that ``pip install "<wheel>[extras]"`` resolved
  from the wheel's own metadata (never from requirements/). It is made once per hash of the wheel's
  ``Requires-Dist`` lines for those extras (and the Python version), next to the environments of
  ``scripts/env.sh``; the project itself is uninstalled from it afterwards.
* :func:`overlay_env`: a fresh venv that sees the deps venv's packages through a ``.pth`` file, into
  which the freshly built wheel is installed non-editable with ``--no-deps`` (a few seconds).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Iterable, List, Tuple

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "paddle-fullparam-callbacks"


def clean_env(**extra) -> dict:
    """The environment of a user's shell: nothing that points at a checkout, an env or a make run."""
    drop = {"PYTHONPATH", "PFC_RECIPES_DIR", "VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL",
            "PIP_REQUIRE_VIRTUALENV", "PYTEST_ADDOPTS"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def run(cmd, *, cwd=None, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


def copy_checkout(dst: Path, src: Path = ROOT) -> Path:
    """The files of a clone of ``src`` as it is now: tracked and new (not ignored) files, deleted ones left out."""
    proc = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=src, capture_output=True)
    if proc.returncode != 0:  # not a git checkout (an unpacked sdist): everything but caches
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info", "build", "dist", "demo_output"))
        return dst
    for rel in proc.stdout.decode().split("\0"):
        s = src / rel
        if not rel or not os.path.lexists(s):
            continue
        d = dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        else:
            shutil.copy2(s, d)
    return dst


def build(src: Path, outdir: Path, python: str = sys.executable) -> Tuple[Path, Path]:
    """(sdist, wheel) of ``src``; the wheel is built from the unpacked sdist, so it holds what the sdist holds."""
    run([python, "-m", "build", "--outdir", outdir, src], env=clean_env(), timeout=600)
    (sdist,), (wheel,) = sorted(outdir.glob("*.tar.gz")), sorted(outdir.glob("*.whl"))
    return sdist, wheel


def requires_dist(wheel: Path, extras: Iterable[str]) -> List[str]:
    """The wheel's ``Requires-Dist`` lines that apply with ``extras`` (and with none), as written in its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(z.read(meta).decode())
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            out.append(line)
    return out


def _digest(lines: Iterable[str]) -> str:
    text = "\n".join(sorted(lines)) + "\n%d.%d" % sys.version_info[:2]
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def env_root() -> Path:
    return Path(run(["bash", ROOT / "scripts" / "env.sh", "--root"]).stdout.strip())


class _Lock:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "w")

    def __enter__(self):
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _pip(python, *args, timeout=1800) -> subprocess.CompletedProcess:
    return run([python, "-m", "pip", *args], timeout=timeout)


def deps_env(wheel: Path, extras: Iterable[str], root: Path) -> Tuple[Path, bool]:
    """(venv, made_now): the third-party packages of ``pip install "<wheel>[extras]"``, resolved once per
    hash of the wheel's own requirements for those extras."""
    extras = list(extras)
    venv = root / f"wheel-{'-'.join(extras)}-{_digest(requires_dist(wheel, extras))}"
    made = False
    with _Lock(venv.with_name(venv.name + ".lock")):
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            run([sys.executable, "-m", "venv", venv])
            py = venv / "bin" / "python"
            _pip(py, "install", "-q", "--upgrade", "pip")
            # the resolution under test: the wheel's metadata with its extras, nothing else
            _pip(py, "install", "-q", f"{wheel}[{','.join(extras)}]")
            _pip(py, "uninstall", "-y", "-q", PROJECT)
            (venv / "resolved.txt").write_text(_pip(py, "freeze", "--all").stdout)
            (venv / ".complete").write_text(json.dumps({"extras": extras, "requires": requires_dist(wheel, extras)}))
            made = True
    return venv, made


def resolve_names(wheel: Path, extras: Iterable[str], root: Path) -> List[str]:
    """The distributions ``pip install "<wheel>[extras]"`` would install into an empty environment
    (a dry run from the wheel's metadata, cached by the hash of its requirements for those extras)."""
    extras = list(extras)
    cache = root / f"resolve-{'-'.join(extras)}-{_digest(requires_dist(wheel, extras))}.json"
    if not cache.exists():
        report = cache.with_name(f"{cache.name}.{os.getpid()}.report")
        _pip(sys.executable, "install", "--dry-run", "--ignore-installed", "-q", "--report", report,
             f"{wheel}[{','.join(extras)}]", timeout=900)
        items = json.loads(report.read_text())["install"]
        names = sorted(re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower() for i in items)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(names))
        os.replace(tmp, cache)
        report.unlink()
    return json.loads(cache.read_text())


def overlay_env(deps: Path, dst: Path) -> Path:
    """A fresh venv at ``dst`` whose site-packages come first, then the deps venv's (its .pth files
    included); returns its python."""
    run([deps / "bin" / "python", "-m", "venv", "--without-pip", dst])
    py = dst / "bin" / "python"
    (purelib(py) / "_pfc_deps.pth").write_text(f"import site; site.addsitedir({str(purelib(deps / 'bin' / 'python'))!r})\n")
    return py


def install_wheel(python: Path, wheel: Path) -> None:
    """The wheel alone, non-editable, no dependency changes (they are the deps venv's)."""
    _pip(python, "install", "-q", "--no-deps", "--no-index", wheel)


def purelib(python: Path) -> Path:
    return Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
