#!/usr/bin/env python3
"""Keep requirements/*.txt in step with pyproject.toml: one source of truth for the constraints.

pyproject.toml's dependencies and extras are what a user gets from ``pip install ".[cpu,paddleformers]"``.
Each pin file of a test environment has two parts:

* above the line ``# ---- from pyproject.toml: dependencies + [EXTRA,...]``: the exact versions the
  environment tests with, written by hand; only ``name==version`` pins and bare names are allowed there
  (a range constraint belongs in pyproject.toml, so that users get it too), and every pin must satisfy
  pyproject's constraints for the same name;
* below that line: the project's dependencies and the named extras, copied from pyproject.toml.

    python3 scripts/sync_requirements.py           # rewrite the lower parts (``make requirements``)
    python3 scripts/sync_requirements.py --check   # exit 1 and say what drifted, change nothing
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^# ---- from pyproject\.toml: dependencies \+ \[([a-z0-9_,-]*)\]")
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _specifier_set():
    try:
        from packaging.specifiers import SpecifierSet
    except ModuleNotFoundError:
        from pip._vendor.packaging.specifiers import SpecifierSet
    return SpecifierSet


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_lines(pyproject: dict, extras) -> list:
    """The project's dependencies, then each extra's, in pyproject's order, without repeats."""
    project = pyproject["project"]
    known = project.get("optional-dependencies", {})
    out = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in known:
            raise SystemExit(f"sync_requirements: pyproject.toml has no extra [{extra}] (it has: {', '.join(known)})")
        out += [r for r in known[extra] if r not in out]
    return out


def render(text: str, pyproject: dict, path: Path) -> str:
    """``text`` with everything below its marker line written from pyproject.toml."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m:
            extras = [e for e in m.group(1).split(",") if e]
            return "\n".join(lines[: i + 1] + project_lines(pyproject, extras)) + "\n"
    raise SystemExit(f"sync_requirements: {path.relative_to(ROOT)} has no line "
                     "'# ---- from pyproject.toml: dependencies + [EXTRA,...]'")


def hand_problems(text: str, pyproject: dict, path: Path) -> list:
    """What is wrong with the hand-written part: range constraints, and pins outside pyproject's ranges."""
    SpecifierSet = _specifier_set()
    head, generated = [], []
    part = head
    for line in text.splitlines():
        if MARKER.match(line):
            part = generated
            continue
        part.append(line)
    ranges = {}
    for req in generated:
        m = NAME.match(req.split(";")[0])
        spec = re.sub(r"^\[[^\]]*\]", "", m.group(2).strip()).strip() if m else ""  # moto[server]>=5.2: the range
        if spec:
            ranges.setdefault(canonical(m.group(1)), []).append(spec)
    rel = path.relative_to(ROOT)
    problems = []
    for line in head:
        req = line.split("#", 1)[0].strip()
        if not req:
            continue
        m = NAME.match(req)
        spec = m.group(2).strip() if m else req
        if m is None or (spec and not re.fullmatch(r"==\s*[A-Za-z0-9.+!*_-]+", spec)):
            problems.append(f"{rel}: '{req}' above the pyproject.toml line: only name==version pins and bare "
                            "names go there; put a range constraint in pyproject.toml's extras")
            continue
        version = spec[2:].strip()
        for allowed in ranges.get(canonical(m.group(1)), []):
            if version and version not in SpecifierSet(allowed):
                problems.append(f"{rel}: {m.group(1)}=={version} is outside pyproject.toml's '{m.group(1)}{allowed}'")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is not what pyproject.toml gives")
    ns = ap.parse_args(argv)
    pyproject = _toml(ROOT / "pyproject.toml")
    drift, problems = [], []
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        old = path.read_text()
        new = render(old, pyproject, path)
        problems += hand_problems(new, pyproject, path)
        if new == old:
            continue
        if ns.check:
            rel = str(path.relative_to(ROOT))
            drift.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel + " (from pyproject.toml)")))
        else:
            path.write_text(new)
            print(f"sync_requirements: wrote {path.relative_to(ROOT)}")
    for d in drift:
        print(d, end="", file=sys.stderr)
    if drift:
        print("sync_requirements: requirements/ and pyproject.toml disagree: run `make requirements`", file=sys.stderr)
    for p in problems:
        print(f"sync_requirements: {p}", file=sys.stderr)
    return 1 if drift or problems else 0


if __name__ == "__main__":
    sys.exit(main())
