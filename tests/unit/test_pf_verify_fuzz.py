"""Fuzzing verify: mutations of a valid snapshot's manifest, index and safetensors headers (byte
flips, truncations, JSON structure edits, random JSON values at every path, names that leave the
snapshot, links, FIFOs, directories) and of an output directory's pointers. For every case:
verify returns a report (no exception), ``--json`` prints one object, and nothing outside the
snapshot (or output directory) is opened: every descriptor opened is resolved through
``/proc/self/fd`` and checked. ``bench/verify_fuzz.py`` runs the same generators with a larger
count and records the figures.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paddle_fullparam_callbacks.cli.main import main
from paddle_fullparam_callbacks.export.verify.snapshot import VerifyReport, verify_snapshot
from paddle_fullparam_callbacks.export.verify.tree import OutputDirReport, verify_path
from test_verify_hardened import INDEX, MANIFEST, OpenRecorder, build_output_dir, build_snapshot

# ---- the environment: templates to copy, and files outside that a fooled verify would open ---------


class FuzzEnv:
    """Templates (a sharded snapshot, a one-file snapshot, an output directory) and, beside them,
    ``outside/`` with an intact shard, a manifest and a text file: bait for escaping names and links."""

    def __init__(self, base: Path):
        self.base = Path(base)
        t = self.base / "templates"
        self.templates = {"multi": build_snapshot(t / "multi", n=4, shard=300),
                          "single": build_snapshot(t / "single", n=4, shard=10_000)}
        self.output = build_output_dir(t / "output", steps=(1, 2))
        self.outside = self.base / "outside"
        self.outside.mkdir()
        shutil.copy(self.templates["single"] / "model.safetensors", self.outside / "secret.safetensors")
        shutil.copy(self.templates["multi"] / MANIFEST, self.outside / "secret.json")
        (self.outside / "secret.txt").write_text("secret")
        self.cases = 0
        self._n = 0

    def fresh(self, template: Path) -> Path:
        self._n += 1
        root = self.base / f"case-{self._n}"
        root.mkdir()
        return Path(shutil.copytree(template, root / template.name, symlinks=True))

    def evil_names(self):
        o = self.outside
        return ["../secret.txt", "../../outside/secret.safetensors", "../../outside/secret.json", str(o / "secret.txt"),
                str(o / "secret.safetensors"), "/etc/hostname", "../../etc/hostname", "..", ".", "", "a/b.safetensors",
                "x\0y", "a\\b", "\ud800.safetensors", "model.safetensors", MANIFEST, INDEX, "config.json",
                "link.safetensors", "fifo.safetensors", "hf-step-000001", "latest", ".fullparam.lock", "x" * 300]


# ---- strategies: plain tuples, applied by apply() -------------------------------------------------

_ints = st.integers(0, 2**16)
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
            | st.sampled_from([0, 1, -1, 2**63, 2**64 - 1, "F32", "BF16", "float32", "", "0" * 64]))


def _values(names):
    leaves = _scalars | st.sampled_from(names)
    keys = st.text(max_size=8) | st.sampled_from(names + ["files", "bytes", "sha256", "weight_map", "metadata",
                                                          "total_size", "num_tensors", "dtype", "shape", "data_offsets",
                                                          "__metadata__"])
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys, c, max_size=4), max_leaves=8)


def byte_mutations():
    target = st.sampled_from(["multi", "single"])
    return st.one_of(
        st.tuples(st.just("flip"), target, _ints, st.lists(st.tuples(_ints, st.integers(1, 255)), min_size=1, max_size=8)),
        st.tuples(st.just("truncate"), target, _ints, _ints),
        st.tuples(st.just("insert"), target, _ints, _ints, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("replace"), target, _ints, st.binary(max_size=64)),
        st.tuples(st.just("header_len"), target, _ints, st.integers(0, 2**64 - 1)
                  | st.sampled_from([0, 1, 7, 8, 2**63, 2**64 - 1, 100 * 2**20, 100 * 2**20 + 1])),
    )


def json_mutations(names):
    target = st.sampled_from(["multi", "single"])
    path = st.lists(_ints, max_size=5)
    return st.one_of(
        st.tuples(st.just("set"), target, _ints, path, _values(names), st.booleans()),
        st.tuples(st.just("delete"), target, _ints, path, st.booleans()),
        st.tuples(st.just("rekey"), target, _ints, path, st.sampled_from(names) | st.text(max_size=8), st.booleans()),
        st.tuples(st.just("duplicate"), target, _ints),
        st.tuples(st.just("deep"), target, _ints, st.sampled_from([500, 5_000, 200_000]), st.sampled_from(["[", '{"a":'])),
    )


def path_mutations(names):
    target = st.sampled_from(["multi", "single"])
    link_to = st.sampled_from(["outside-shard", "outside-text", "inside", "dangling", "self-dir", "parent"])
    return st.one_of(
        st.tuples(st.just("evil_file"), target, st.sampled_from(names)),
        st.tuples(st.just("evil_index"), target, _ints, st.sampled_from(names)),
        st.tuples(st.just("link"), target, _ints, link_to),
        st.tuples(st.just("node"), target, _ints, st.sampled_from(["dir", "fifo", "unlink"])),
        st.tuples(st.just("extra"), target, st.sampled_from(["link.safetensors", "x.safetensors", "fifo.safetensors",
                                                             "dir.safetensors"]), link_to),
    )


def snapshot_cases(names):
    one = byte_mutations() | json_mutations(names) | path_mutations(names)
    return st.lists(one, min_size=1, max_size=3)


def output_cases(names):
    pointer = st.sampled_from(["latest", "best"])
    entry = st.sampled_from(["hf-step-000001", "hf-step-000002", "latest", "best", ".tmp-x", "user", ".fullparam.lock"])
    return st.lists(st.one_of(
        st.tuples(st.just("pointer_text"), pointer, st.sampled_from(names) | st.text(max_size=20)),
        st.tuples(st.just("pointer_bytes"), pointer, st.binary(max_size=5000)),
        st.tuples(st.just("entry"), entry, st.sampled_from(["link-out", "link-in", "dir", "file", "fifo", "unlink",
                                                            "no-manifest"])),
        st.tuples(st.just("inner"), st.sampled_from(["hf-step-000001", "hf-step-000002"]),
                  byte_mutations() | json_mutations(names) | path_mutations(names)),
    ), min_size=1, max_size=4)


# ---- applying a mutation --------------------------------------------------------------------------

def _pick(snap: Path, i: int, suffix: str = "") -> Path:
    names = sorted(p.name for p in snap.iterdir() if p.name.endswith(suffix)) or sorted(p.name for p in snap.iterdir())
    return snap / names[i % len(names)] if names else snap / "nothing"


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes() if p.is_file() and not p.is_symlink() else b""
    except OSError:
        return b""


def _split(p: Path):
    """(header object or None, header bytes, data) of a shard; (object, text, b"") of a JSON file."""
    raw = _read(p)
    if p.name.endswith(".safetensors") and len(raw) >= 8:
        n = int.from_bytes(raw[:8], "little")
        head, data = raw[8:8 + n], raw[8 + n:]
    else:
        head, data = raw, None
    try:
        return json.loads(head), head, data
    except (ValueError, RecursionError):
        return None, head, data


def _join(p: Path, text: bytes, data, old_len=None) -> None:
    if os.path.lexists(p) and (p.is_symlink() or not p.is_file()):
        return  # writing into a FIFO would block, through a link would write outside
    if data is None:
        p.write_bytes(text)
    else:
        p.write_bytes((len(text) if old_len is None else old_len).to_bytes(8, "little") + text + data)


def _walk(obj, path):
    parent, key, node = None, None, obj
    for i in path:
        if isinstance(node, dict) and node:
            key = list(node)[i % len(node)]
        elif isinstance(node, list) and node:
            key = i % len(node)
        else:
            break
        parent, node = node, node[key]
    return parent, key


def _edit_json(p: Path, fn, fix_len: bool) -> None:
    obj, head, data = _split(p)
    if obj is None:
        return
    obj = fn(obj)
    text = json.dumps(obj).encode("utf-8", "surrogatepass")
    _join(p, text, data, None if fix_len else len(head))


def _set(path, value):
    def fn(obj):
        parent, key = _walk(obj, path)
        if parent is None:
            return value
        parent[key] = value
        return obj
    return fn


def _delete(path):
    def fn(obj):
        parent, key = _walk(obj, path)
        if parent is not None:
            del parent[key]
        return obj
    return fn


def _rekey(path, new):
    def fn(obj):
        parent, key = _walk(obj, path)
        if isinstance(parent, dict):
            parent[new] = parent.pop(key)
        return obj
    return fn


def _link(env: FuzzEnv, p: Path, to: str) -> None:
    target = {"outside-shard": env.outside / "secret.safetensors", "outside-text": env.outside / "secret.txt",
              "dangling": p.parent / "nothing-here", "self-dir": p.parent, "parent": Path("..")}.get(to)
    if to == "inside":
        others = sorted(q for q in p.parent.iterdir() if q.name != p.name and q.is_file())
        target = others[0].name if others else "x"
    if os.path.lexists(p):
        p.unlink() if not p.is_dir() or p.is_symlink() else shutil.rmtree(p)
    os.symlink(target, p)


def _node(p: Path, kind: str) -> None:
    if os.path.lexists(p):
        p.unlink() if not p.is_dir() or p.is_symlink() else shutil.rmtree(p)
    if kind == "dir":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "file":
        p.write_text("user file")


def apply(env: FuzzEnv, snap: Path, m: tuple) -> None:
    """Apply one mutation tuple (see the strategies) to the snapshot copy ``snap``."""
    op, args = m[0], m[2:]
    if op in ("flip", "truncate", "insert", "replace", "header_len"):
        p = _pick(snap, args[0])
        raw = bytearray(_read(p))
        if op == "flip":
            for pos, x in args[1]:
                if raw:
                    raw[pos % len(raw)] ^= x
        elif op == "truncate":
            del raw[args[1] % (len(raw) + 1):]
        elif op == "insert":
            raw[args[1] % (len(raw) + 1):args[1] % (len(raw) + 1)] = args[2]
        elif op == "replace":
            raw = bytearray(args[1])
        else:
            p = _pick(snap, args[0], ".safetensors")
            raw = bytearray(args[1].to_bytes(8, "little") + _read(p)[8:])
        if p.is_file() and not p.is_symlink():
            p.write_bytes(bytes(raw))
    elif op in ("set", "delete", "rekey"):
        p = _pick(snap, args[0], ".json") if args[0] % 2 else _pick(snap, args[0] // 2, ".safetensors")
        fn = {"set": lambda: _set(args[1], args[2]), "delete": lambda: _delete(args[1]),
              "rekey": lambda: _rekey(args[1], args[2])}[op]()
        _edit_json(p, fn, args[-1])
    elif op == "duplicate":
        p = _pick(snap, args[0])
        obj, head, data = _split(p)
        if isinstance(obj, dict) and obj:
            key = json.dumps(next(iter(obj)))
            _join(p, b"{" + key.encode() + b": 1, " + head.lstrip()[1:], data)
    elif op == "deep":
        p = _pick(snap, args[0])
        _join(p, (args[2] * args[1]).encode(), b"" if p.name.endswith(".safetensors") else None)
    elif op == "evil_file":
        _edit_json(snap / MANIFEST, lambda m: (m.get("files", {}).__setitem__(args[0], {"bytes": 6, "sha256": "0" * 64})
                                               if isinstance(m, dict) and isinstance(m.get("files"), dict) else None) or m, True)
    elif op == "evil_index":
        def evil(idx):
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if isinstance(wm, dict) and wm:
                wm[list(wm)[args[0] % len(wm)]] = args[1]
            return idx
        if (snap / INDEX).exists():
            _edit_json(snap / INDEX, evil, True)
        else:  # the one-file layout: the header's tensor names are the index
            _edit_json(snap / "model.safetensors", _rekey([args[0]], args[1]), True)
    elif op == "link":
        _link(env, _pick(snap, args[0]), args[1])
    elif op == "node":
        _node(_pick(snap, args[0]), args[1])
    elif op == "extra":
        if args[1] in ("dangling", "inside", "outside-shard", "outside-text"):
            _link(env, snap / args[0], args[1])
        else:
            _node(snap / args[0], "fifo" if "fifo" in args[0] else "dir" if "dir" in args[0] else "file")


def apply_output(env: FuzzEnv, out: Path, m: tuple) -> None:
    op = m[0]
    if op == "pointer_text":
        _node(out / m[1], "none")
        (out / m[1]).write_bytes(m[2].encode("utf-8", "surrogatepass") + b"\n")
    elif op == "pointer_bytes":
        _node(out / m[1], "none")
        (out / m[1]).write_bytes(m[2])
    elif op == "entry":
        p = out / m[1]
        if m[2] == "link-out":
            _node(p, "none")
            os.symlink(env.templates["multi"], p)  # an intact snapshot, outside: must not be followed
        elif m[2] == "link-in":
            _node(p, "none")
            os.symlink("hf-step-000001", p)
        elif m[2] == "no-manifest":
            if (p / MANIFEST).is_file() and not p.is_symlink():
                (p / MANIFEST).unlink()
        else:
            _node(p, m[2] if m[2] != "unlink" else "none")
    elif op == "inner" and (out / m[1]).is_dir() and not (out / m[1]).is_symlink():
        apply(env, out / m[1], m[2])


# ---- running a case -------------------------------------------------------------------------------

class Escaped(AssertionError):
    """verify opened something outside the directory it checks."""


class MutationFailed(RuntimeError):
    """A bug of this file's generators, not of verify (the bench counts it apart)."""


def _mutate(fn, target: Path, mutations) -> None:
    try:
        with _deadline():
            for m in mutations:
                fn(target, m)
    except Exception as e:
        raise MutationFailed(f"applying {m!r}: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _deadline(seconds: int = 20):
    """A hang (e.g. a FIFO opened without O_NONBLOCK) fails the case instead of the whole run."""
    def hang(*_):
        raise TimeoutError(f"verify did not return within {seconds} s")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _inside(paths, root: Path, deep: bool):
    root = os.path.realpath(root)
    return [p for p in paths if not (p == root or (p.startswith(root + "/") if deep else os.path.dirname(p) == root))]


def run_snapshot_case(env: FuzzEnv, mutations, via_cli: bool = False) -> VerifyReport:
    """Mutate a copy of a template, verify it; raises on an exception or an open outside it."""
    env.cases += 1
    snap = env.fresh(env.templates[mutations[0][1]])
    try:
        _mutate(lambda d, m: apply(env, d, m), snap, mutations)
        with _deadline(), OpenRecorder() as rec:
            if via_cli:
                report = _cli(snap)
            else:
                report = verify_snapshot(snap)
        escaped = _inside(rec.paths, snap, deep=False)
        if escaped:
            raise Escaped(f"opened outside {snap}: {escaped}")
        return report
    finally:
        shutil.rmtree(snap.parent, ignore_errors=True)


def run_output_case(env: FuzzEnv, mutations) -> OutputDirReport:
    env.cases += 1
    out = env.fresh(env.output)
    try:
        _mutate(lambda d, m: apply_output(env, d, m), out, mutations)
        with _deadline(), OpenRecorder() as rec:
            report = verify_path(out)
        escaped = _inside(rec.paths, out, deep=True)
        if escaped:
            raise Escaped(f"opened outside {out}: {escaped}")
        assert isinstance(report.as_dict(), dict)
        return report
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def _cli(path: Path):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["verify", "--json", str(path)])
    obj = json.loads(stdout.getvalue())  # exactly one JSON object, or this raises
    assert isinstance(obj, dict) and code in (0, 1) and obj["ok"] is (code == 0), (code, obj)
    if any(e.startswith("verify failed:") for e in obj["errors"]):
        raise RuntimeError(f"verify raised: {obj['errors']}")
    return obj


def new_env() -> FuzzEnv:
    return FuzzEnv(Path(tempfile.mkdtemp(prefix="verify-fuzz-")))


# ---- the tests (bench/verify_fuzz.py runs the same with larger counts) -----------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory) -> FuzzEnv:
    return FuzzEnv(tmp_path_factory.mktemp("verify-fuzz"))


_FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))

# (name, strategy of one case, runner, examples in the unit tests: the bench keeps these proportions)
GENERATORS = (
    ("bytes", lambda env: st.lists(byte_mutations(), min_size=1, max_size=3), run_snapshot_case, 1200),
    ("json", lambda env: st.lists(json_mutations(env.evil_names()), min_size=1, max_size=3), run_snapshot_case, 1200),
    ("names_and_links", lambda env: st.lists(path_mutations(env.evil_names()), min_size=1, max_size=3),
     run_snapshot_case, 1000),
    ("mixed_cli", lambda env: snapshot_cases(env.evil_names()),
     lambda env, ms: run_snapshot_case(env, ms, via_cli=True), 500),
    ("output_dir", lambda env: output_cases(env.evil_names()), run_output_case, 500),
)


def run_generator(env: FuzzEnv, name: str, examples: int, on_case=None) -> int:
    """Run one generator for ``examples`` cases; ``on_case(ms)`` replaces the runner (the bench
    wraps it to count failures instead of stopping). Returns the number of cases run."""
    _, strategy, runner, _ = next(g for g in GENERATORS if g[0] == name)
    before = env.cases

    @settings(_FUZZ, max_examples=examples)
    @given(strategy(env))
    def case(ms):
        (on_case or (lambda m: runner(env, m)))(ms)

    case()
    return env.cases - before


@pytest.mark.parametrize("name, examples", [(g[0], g[3]) for g in GENERATORS], ids=[g[0] for g in GENERATORS])
def test_fuzz(env, name, examples):
    ran = run_generator(env, name, examples)
    assert ran >= examples * 0.9  # the cases really ran (a strategy filtering everything out would pass silently)
    # and no mutation reached the templates or the bait (through a link, say): the next cases start clean
    assert all(verify_snapshot(t).ok for t in env.templates.values()) and verify_path(env.output).ok
    assert (env.outside / "secret.txt").read_text() == "secret"
