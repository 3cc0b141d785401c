"""verify cannot be fooled: names from the files stay inside the snapshot, links are refused,
malformed JSON and headers are reported (never raised), output directories and pointers."""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from paddle_fullparam_callbacks.cli.main import main
from paddle_fullparam_callbacks.export.verify import paths as verify_paths
from paddle_fullparam_callbacks.export.verify import snapshot as verify
from paddle_fullparam_callbacks.export.verify.snapshot import verify_snapshot
from paddle_fullparam_callbacks.export.verify.tree import OutputDirReport, PointerReport, verify_path
from paddle_fullparam_callbacks.export.write import checksum
from paddle_fullparam_callbacks.export.write.writer import SnapshotWriter
from paddle_fullparam_callbacks.plan.export_plan import TensorSpec, build_export_plan

MANIFEST = "fullparam_manifest.json"
INDEX = "model.safetensors.index.json"


def _describe(data: bytes) -> dict:
    # written as the old (SHA-256) manifests were: verify reads both algorithms
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def build_snapshot(d: Path, step: int = 7, n: int = 6, shard: int = 200) -> Path:
    """A complete snapshot made as the exporter makes it (shards, index if several, config, manifest
    last), without the commit module: several files with the default ``shard``, one with 10_000."""
    specs = [TensorSpec(f"layers.{i}.w", (4, 8), "float32") for i in range(n)]
    plan = build_export_plan(specs, shard)
    d.mkdir(parents=True)
    w = SnapshotWriter(plan, d, background=False)
    for s in specs:
        w.put(s.name, np.full(s.shape, step, np.float32))
    files = {k: {"bytes": v.bytes, checksum.DEFAULT: v.digest} for k, v in w.close().items()}
    side = {"config.json": {"architectures": ["LlamaForCausalLM"]}}
    if plan.needs_index:
        side[INDEX] = plan.index()
    for name, obj in side.items():
        data = json.dumps(obj, indent=2).encode()
        (d / name).write_bytes(data)
        files[name] = _describe(data)
    manifest = {"manifest_version": 1, "step": step, "num_tensors": n, "files": dict(sorted(files.items()))}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return d


def build_output_dir(out: Path, steps=(1, 2)) -> Path:
    for step in steps:
        build_snapshot(out / f"hf-step-{step:06d}", step)
    (out / "latest").write_text(f"hf-step-{steps[-1]:06d}\n")
    (out / "best").write_text(f"hf-step-{steps[0]:06d}\n")
    return out


def edit_json(path: Path, fn) -> None:
    """Edit the JSON file in place; an ``fn`` returning a list replaces the whole object."""
    obj = json.loads(path.read_text())
    res = fn(obj)
    path.write_text(json.dumps(res if isinstance(res, list) else obj))


def shards(d: Path):
    return sorted(d.glob("*.safetensors"))


class OpenRecorder(contextlib.AbstractContextManager):
    """Records the real path of everything opened (``os.open``, ``open``, ``Path.open``) while active:
    read from ``/proc/self/fd``, so what was really opened, however the name was spelt."""

    def __init__(self):
        self.paths = []
        self._saved = []

    def _record(self, fd: int) -> None:
        try:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            self.paths.append(f"<fd {fd}>")

    def __enter__(self):
        real_os_open, real_open = os.open, io.open

        def os_open(*a, **k):
            fd = real_os_open(*a, **k)
            self._record(fd)
            return fd

        def py_open(file, *a, **k):
            f = real_open(file, *a, **k)
            if not isinstance(file, int):
                self._record(f.fileno())
            return f

        for mod, attr, fn in ((os, "open", os_open), (io, "open", py_open), (builtins, "open", py_open)):
            self._saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, fn)
        return self

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self._saved):
            setattr(mod, attr, fn)
        self._saved.clear()
        return False

    def outside(self, root: Path):
        """What was opened that is neither ``root`` nor directly in it."""
        root = os.path.realpath(root)
        return [p for p in self.paths if p != root and os.path.dirname(p) != root]


def run_cli(*args, capsys):
    code = main(["verify", *map(str, args)])
    out = capsys.readouterr().out
    return code, out


@pytest.fixture
def snap(tmp_path):
    return build_snapshot(tmp_path / "out" / "hf-step-000007")


@pytest.fixture
def single(tmp_path):
    return build_snapshot(tmp_path / "out" / "hf-step-000008", shard=10_000)


@pytest.fixture
def secret(tmp_path):
    """A file outside the snapshot that a fooled verify would open."""
    p = tmp_path / "secret.txt"
    p.write_text("secret")
    return p


def test_snapshots_of_the_builder_verify(snap, single):
    assert len(shards(snap)) > 1 and (snap / INDEX).exists() and verify_snapshot(snap).ok
    assert [p.name for p in shards(single)] == ["model.safetensors"] and not (single / INDEX).exists()
    r = verify_snapshot(single)
    assert r.ok and r.tensors == 6, r.errors


# ---- names from the files: plain names inside the snapshot, no links ------------------------------

@pytest.mark.parametrize("name", ["../../etc/hostname", "../secret.txt", "/etc/hostname", "sub/x.json", "..", ".", "",
                                  "a\0b", "a\\b"])
def test_manifest_names_outside_the_snapshot_are_damage_and_never_opened(snap, secret, name):
    edit_json(snap / MANIFEST, lambda m: m["files"].__setitem__(name, {"bytes": 6, "sha256": "0" * 64}))
    with OpenRecorder() as rec:
        r = verify_snapshot(snap)
    assert f"{MANIFEST}: files: {name!r} is not a plain file name inside the snapshot" in r.errors
    assert not r.ok and rec.outside(snap) == [] and str(secret) not in rec.paths


def test_the_message_of_the_issue(snap):
    edit_json(snap / MANIFEST, lambda m: m["files"].__setitem__("../../etc/hostname", {"bytes": 1, "sha256": "0" * 64}))
    assert verify_snapshot(snap).errors == [f"{MANIFEST}: files: '../../etc/hostname' is not a plain file name inside the snapshot"]


def test_a_lone_surrogate_is_not_a_file_name(snap):
    raw = (snap / MANIFEST).read_text().replace('"config.json"', '"\\ud800.json"')
    (snap / MANIFEST).write_text(raw)
    assert f"{MANIFEST}: files: '\\ud800.json' is not a valid file name" in verify_snapshot(snap).errors


def test_index_names_outside_the_snapshot(snap, secret):
    def evil(idx):
        idx["weight_map"]["layers.0.w"] = "../secret.txt"
        idx["weight_map"]["layers.1.w"] = 5
    edit_json(snap / INDEX, evil)
    with OpenRecorder() as rec:
        r = verify_snapshot(snap)
    assert f"{INDEX}: weight_map['layers.0.w']: '../secret.txt' is not a plain file name inside the snapshot" in r.errors
    assert f"{INDEX}: weight_map['layers.1.w']: 5 is a number, not a file name" in r.errors
    assert rec.outside(snap) == []


@pytest.mark.parametrize("inside", [False, True], ids=["to-outside", "to-inside"])
def test_a_shard_that_is_a_symlink_is_damaged_and_not_followed(tmp_path, single, inside):
    shard = single / "model.safetensors"
    target = single / "copy.bin" if inside else tmp_path / "outside.safetensors"
    os.replace(shard, target)  # an intact copy: following the link would verify OK
    os.symlink(target, shard)
    with OpenRecorder() as rec:
        r = verify_snapshot(single)
    assert not r.ok and any(e.startswith("model.safetensors: is a symbolic link") for e in r.errors), r.errors
    assert str(target) not in rec.paths and rec.outside(single) == []


@pytest.mark.parametrize("name", [MANIFEST, INDEX, "config.json"])
def test_any_listed_file_that_is_a_symlink_is_damaged(tmp_path, snap, name):
    os.replace(snap / name, tmp_path / name)
    os.symlink(tmp_path / name, snap / name)
    with OpenRecorder() as rec:
        r = verify_snapshot(snap)
    assert any(e.startswith(f"{name}: is a symbolic link") for e in r.errors), r.errors
    assert rec.outside(snap) == []


def test_an_unlisted_shard_link_is_named(tmp_path, snap, secret):
    os.symlink(secret, snap / "extra.safetensors")
    errors = verify_snapshot(snap).errors
    assert "extra.safetensors: on disk but not in the manifest; it is a symbolic link (never followed: a link can lead " \
           "outside the directory)" in errors


def test_a_directory_a_fifo_and_a_vanished_file(snap, monkeypatch):
    a, b = shards(snap)[:2]
    a.unlink()
    a.mkdir()
    b.unlink()
    os.mkfifo(b)  # opening it for reading would block without O_NONBLOCK
    errors = verify_snapshot(snap).errors
    assert f"{a.name}: is a directory, not a file" in errors
    assert f"{b.name}: is not a regular file (a FIFO, socket or device)" in errors
    # a file removed between the listing and the open
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (_ for _ in ()).throw(FileNotFoundError(2, "gone"))
                        if p == "config.json" else real_open(p, *a, **k))
    assert "config.json: vanished while it was checked" in verify_snapshot(snap).errors


# ---- malformed JSON: every wrong type named with its key --------------------------------------------

@pytest.mark.parametrize("value, kind", [([1, 2], "a list"), (5, "a number"), ("x", "a string"), (None, "null")])
def test_manifest_that_is_not_an_object(snap, value, kind):
    (snap / MANIFEST).write_text(json.dumps(value))
    assert verify_snapshot(snap).errors == [f"{MANIFEST}: is {kind}, not an object"]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__("files", [1]), f"{MANIFEST}: files: is a list, not an object"),
    (lambda m: m.pop("files"), f"{MANIFEST}: has no 'files' table"),
    (lambda m: m["files"].__setitem__("config.json", "x"),
     f"{MANIFEST}: files['config.json']: is a string, not an object with 'bytes' and a checksum (blake3 or sha256)"),
    (lambda m: m["files"]["config.json"].__setitem__("bytes", "12"),
     f"{MANIFEST}: files['config.json'].bytes: is '12', not a whole number >= 0"),
    (lambda m: m["files"]["config.json"].__setitem__("bytes", True),
     f"{MANIFEST}: files['config.json'].bytes: is True, not a whole number >= 0"),
    (lambda m: m["files"]["config.json"].__setitem__("bytes", -1),
     f"{MANIFEST}: files['config.json'].bytes: is -1, not a whole number >= 0"),
    (lambda m: m["files"]["config.json"].__setitem__("sha256", 5),
     f"{MANIFEST}: files['config.json'].sha256: is 5, not 64 hex digits"),
    (lambda m: m["files"]["config.json"].pop("sha256"),
     f"{MANIFEST}: files['config.json'].sha256: is missing, not 64 hex digits"),
    (lambda m: m.__setitem__("num_tensors", "6"), f"{MANIFEST}: num_tensors: is '6', not a whole number >= 0"),
])
def test_manifest_fields_of_the_wrong_type(snap, edit, message):
    edit_json(snap / MANIFEST, edit)
    assert message in verify_snapshot(snap).errors


def _resign_index(snap):
    data = (snap / INDEX).read_bytes()
    edit_json(snap / MANIFEST, lambda m: m["files"].__setitem__(INDEX, _describe(data)))


@pytest.mark.parametrize("edit, message", [
    (lambda i: [i], f"{INDEX}: is a list, not an object"),
    (lambda i: i.__setitem__("weight_map", ["a"]), f"{INDEX}: weight_map: is a list, not an object"),
    (lambda i: i.pop("weight_map"), f"{INDEX}: has no 'weight_map'"),
    (lambda i: i.__setitem__("metadata", [1]), f"{INDEX}: metadata: is a list, not an object"),
    (lambda i: i["metadata"].__setitem__("total_size", "1"), f"{INDEX}: metadata.total_size: is '1', not a whole number >= 0"),
    (lambda i: i["weight_map"].__setitem__("layers.0.w", "config.json"),
     f"{INDEX}: tensors 'layers.0.w' point to 'config.json', which is not a .safetensors file"),
    (lambda i: i["weight_map"].__setitem__("layers.0.w", "other.safetensors"),
     f"{INDEX}: tensors 'layers.0.w' point to 'other.safetensors', which the manifest does not list"),
])
def test_index_fields_of_the_wrong_type(snap, edit, message):
    edit_json(snap / INDEX, edit)
    _resign_index(snap)
    assert message in verify_snapshot(snap).errors


@pytest.mark.parametrize("name", [MANIFEST, INDEX])
@pytest.mark.parametrize("content, reason", [
    (b"[" * 200_000, "is not valid JSON (nested too deeply)"),
    (b'{"files": {}, "files": {}}', "has a duplicate key 'files'"),
    (b'{"files": NaN}', "is not valid JSON (NaN is not JSON)"),
    (b'{"files": "\xff"}', "is not UTF-8 (invalid start byte at byte 11)"),
    (b"", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
])
def test_json_that_would_crash_or_mislead_json_loads(snap, name, content, reason):
    (snap / name).write_bytes(content)
    if name == INDEX:
        _resign_index(snap)
    assert f"{name}: {reason}" in verify_snapshot(snap).errors


def test_a_huge_manifest_is_not_read(snap, monkeypatch):
    monkeypatch.setattr(verify_paths, "MAX_JSON_BYTES", 100)
    size = (snap / MANIFEST).stat().st_size
    assert verify_snapshot(snap).errors == [f"{MANIFEST}: is {size} bytes, over the limit of 100 for this file"]


@pytest.mark.parametrize("extra", [0, 1], ids=["at-the-limit", "one-byte-over"])
def test_a_pointer_is_read_up_to_its_limit(tmp_path, monkeypatch, extra):
    """``tree.POINTER_LIMIT`` on both sides: a pointer of that many bytes is read (here it names no snapshot), one
    byte more is refused unread."""
    from paddle_fullparam_callbacks.export.verify import tree

    monkeypatch.setattr(tree, "POINTER_LIMIT", 12)
    (tmp_path / "latest").write_text("hf-step-0001" + "2" * extra)
    errors = verify_path(tmp_path / "latest").errors
    if extra:
        assert errors == ["latest: is over 12 bytes"], errors
    else:
        assert errors and "names 'hf-step-0001', which does not exist" in errors[0], errors


# ---- safetensors headers ---------------------------------------------------------------------------

def _rewrite_header(path: Path, header, length=None):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if length is None else length
    path.write_bytes(length.to_bytes(8, "little") + text + raw[8 + n:])


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])


def _with(h, fn):
    fn(h)
    return h


@pytest.mark.parametrize("make, message", [
    (lambda p: (2**64 - 1, None), "header length 18446744073709551615 is over the limit of 104857600 bytes"),
    (lambda p: (2**63 + 8, None), "header length 9223372036854775816 is over the limit of 104857600 bytes"),
    (lambda p: (None, b"[" * 200_000), "header is not valid JSON (nested too deeply)"),
    (lambda p: (None, b"[1, 2]"), "header is not a JSON object"),
    (lambda p: (None, b'{"a": 1, "a": 2}'), "header has a duplicate key 'a'"),
    (lambda p: (None, b'{"\xff": 1}'), "header is not UTF-8 (invalid start byte at byte 2)"),
    (lambda p: (None, _with(_header(p), lambda h: h["layers.0.w"].__setitem__("shape", [True, 8]))),
     "tensor 'layers.0.w' has invalid shape [True, 8]"),
    (lambda p: (None, _with(_header(p), lambda h: h["layers.0.w"].__setitem__("data_offsets", [False, 128]))),
     "tensor 'layers.0.w' has invalid offsets [False, 128]"),
    (lambda p: (None, _with(_header(p), lambda h: h["layers.0.w"].__setitem__("shape", "48"))),
     "tensor 'layers.0.w' has invalid shape '48'"),
    (lambda p: (None, _with(_header(p), lambda h: h.__setitem__("layers.0.w", [1]))),
     "tensor 'layers.0.w' has a malformed header entry [1]"),
    (lambda p: (None, _with(_header(p), lambda h: h.__setitem__("__metadata__", [1]))),
     "__metadata__ is a list, not an object"),
])
def test_bad_headers_are_named(single, make, message):
    p = single / "model.safetensors"
    length, header = make(p)
    if header is not None:
        _rewrite_header(p, header)
    else:
        raw = p.read_bytes()
        p.write_bytes(length.to_bytes(8, "little") + raw[8:])
    errors = verify_snapshot(single).errors
    assert f"model.safetensors: {message}" in errors, errors


def test_long_names_are_cut_in_messages(single):
    p = single / "model.safetensors"
    h = _header(p)
    h["x" * 100_000] = h.pop("layers.0.w")
    _rewrite_header(p, h)
    errors = verify_snapshot(single).errors
    assert errors and max(map(len, errors)) < 400, [e[:200] for e in errors]


# ---- output directories and pointers ---------------------------------------------------------------

def test_an_output_dir_checks_every_snapshot_and_pointer(tmp_path):
    out = build_output_dir(tmp_path / "out")
    (out / ".fullparam.lock").write_text("{}")
    (out / ".tmp-hf-step-000003-0123abcd").mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "scratch").mkdir()
    r = verify_path(out)
    assert isinstance(r, OutputDirReport) and r.ok, r.as_dict()
    assert [s.path for s in r.snapshots] == [str(out / "hf-step-000001"), str(out / "hf-step-000002")]
    assert [(p.path, p.target, p.ok) for p in r.pointers] == [(str(out / "latest"), "hf-step-000002", True),
                                                               (str(out / "best"), "hf-step-000001", True)]
    skipped = dict(r.skipped)
    assert sorted(skipped) == [".fullparam.lock", ".tmp-hf-step-000003-0123abcd", "notes.txt", "scratch"]
    assert skipped["scratch"] == f"a directory without {MANIFEST}: not a snapshot, skipped"
    assert skipped["notes.txt"] == "a file: not a snapshot, skipped"


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / "latest").write_text("hf-step-000009\n"), "latest: names 'hf-step-000009', which does not exist in"),
    (lambda out: (out / "latest").write_text("../hf-step-000001\n"),
     "latest: '../hf-step-000001' is not a plain file name inside the output directory"),
    (lambda out: (out / "latest").write_text("\n"), "latest: is empty"),
    (lambda out: (out / "latest").write_bytes(b"\xffhf\n"), "latest: is not UTF-8 (invalid start byte at byte 0)"),
    (lambda out: (out / "latest").write_text("x" * 5000), "latest: is over 4096 bytes"),
    (lambda out: ((out / "latest").unlink(), os.symlink("hf-step-000002", out / "latest")),
     "latest: is a symbolic link (never followed: a link can lead outside the directory)"),
    (lambda out: (out / "hf-step-000002" / "config.json").write_text("{}"),
     "latest: names 'hf-step-000002', which is DAMAGED"),
    (lambda out: ((out / ".fullparam.lock").write_text("{}"), (out / "latest").write_text(".fullparam.lock")),
     "latest: names '.fullparam.lock', which is the lock of the job writing here, not a snapshot"),
    (lambda out: (os.rename(out / "hf-step-000002", out.parent / "elsewhere"), os.symlink(out.parent / "elsewhere", out / "hf-step-000002")),
     "latest: names 'hf-step-000002', which is a symbolic link (not followed), not a snapshot"),
])
def test_a_bad_pointer_is_damage(tmp_path, damage, message):
    out = build_output_dir(tmp_path / "out")
    damage(out)
    with OpenRecorder() as rec:
        r = verify_path(out)
    pointer = next(p for p in r.pointers if p.path.endswith("latest"))
    assert not r.ok and pointer.errors and pointer.errors[0].startswith(message), pointer.errors
    assert [p for p in rec.paths if not p.startswith(str(out))] == []


def test_an_output_dir_without_snapshots(tmp_path):
    (tmp_path / ".fullparam.lock").write_text("{}")
    r = verify_path(tmp_path)
    assert isinstance(r, OutputDirReport) and r.errors == [f"{tmp_path}: holds no snapshot (no directory with a {MANIFEST})"]


def test_a_directory_without_manifest_or_snapshots_is_a_snapshot_without_manifest(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert verify_path(tmp_path).errors == [f"{MANIFEST}: missing"]


def test_glob_of_an_output_dir_verifies_its_pointers(tmp_path, capsys):
    out = build_output_dir(tmp_path / "out")
    paths = sorted(out.iterdir())  # what `verify out/*` passes: the snapshots, best, latest
    code, text = run_cli(*paths, capsys=capsys)
    assert code == 0 and "DAMAGED" not in text, text
    assert f"OK  {out / 'latest'} -> hf-step-000002" in text.splitlines()
    pointer = verify_path(out / "best")
    assert isinstance(pointer, PointerReport) and pointer.ok and pointer.target == "hf-step-000001"


def test_a_snapshot_is_hashed_once_per_run(tmp_path, monkeypatch):
    out = build_output_dir(tmp_path / "out", steps=(1,))
    calls = []
    real = verify._digest
    monkeypatch.setattr("paddle_fullparam_callbacks.export.verify.snapshot._digest",
                        lambda f, a, *more: calls.append(1) or real(f, a, *more))
    cache = {}
    for p in (out, out / "hf-step-000001", out / "latest"):
        assert verify_path(p, cache=cache).ok
    assert len(calls) == len(json.loads((out / "hf-step-000001" / MANIFEST).read_text())["files"])


# ---- the command: one JSON object, exit codes, text that never crashes -------------------------------

@pytest.mark.parametrize("what, code, message", [
    ("missing", 1, "does not exist"),
    ("file", 1, "is a file, not a snapshot or output directory"),
    ("damaged", 1, "sha256 differs"),
    ("ok", 0, None),
])
def test_json_is_one_object_with_the_exit_code(snap, capsys, what, code, message):
    path = {"missing": snap / "nope", "file": snap / "config.json"}.get(what, snap)
    if what == "damaged":
        (snap / "config.json").write_text('{"architectures": ["Llama"]}'.ljust((snap / "config.json").stat().st_size))
    got, out = run_cli(path, "--json", capsys=capsys)
    report = json.loads(out)
    assert got == code and report["ok"] is (code == 0) and report["kind"] == "snapshot"
    assert message is None or any(message in e for e in report["errors"]), report


def test_usage_error_and_internal_error_still_print_one_object(snap, capsys, monkeypatch):
    code, out = run_cli("--json", capsys=capsys)
    assert code == 2 and json.loads(out)["ok"] is False
    monkeypatch.setattr("paddle_fullparam_callbacks.export.verify.tree.verify_path", lambda *a, **k: 1 / 0)
    code, out = run_cli(snap, "--json", capsys=capsys)
    assert code == 1 and json.loads(out) == {"ok": False, "errors": ["verify failed: ZeroDivisionError: division by zero"]}


def test_output_dir_json_and_text(tmp_path, capsys):
    out = build_output_dir(tmp_path / "out")
    (out / "latest").write_text("nothing-here\n")
    code, text = run_cli(out, "--json", capsys=capsys)
    report = json.loads(text)
    assert code == 1 and report["kind"] == "output_dir" and not report["ok"]
    assert [s["ok"] for s in report["snapshots"]] == [True, True]
    assert [(p["target"], p["ok"]) for p in report["pointers"]] == [("nothing-here", False), ("hf-step-000001", True)]
    code, text = run_cli(out, tmp_path / "nope", "--json", capsys=capsys)
    both = json.loads(text)
    assert code == 1 and [s["kind"] for s in both["snapshots"]] == ["output_dir", "snapshot"]
    code, text = run_cli(out, capsys=capsys)
    lines = text.splitlines()
    i = lines.index(f"DAMAGED  {out / 'latest'} -> nothing-here")
    assert lines[i + 1] == f"  - latest: names 'nothing-here', which does not exist in {out}"
    assert lines[-1].startswith(f"DAMAGED  {out}: output directory, 2 snapshot(s) (0 damaged), 2 pointer(s)")


def test_names_that_are_not_utf8_do_not_crash_the_text_output(snap, capsys):
    os.symlink("/nonexistent", os.path.join(os.fsencode(snap), b"\xff.safetensors"))
    code, text = run_cli(snap, capsys=capsys)
    assert code == 1 and "  - '\\udcff.safetensors': on disk but not in the manifest; it is a symbolic link" in text


def test_a_copy_of_the_snapshot_moved_elsewhere_still_verifies(tmp_path, snap):
    moved = shutil.copytree(snap, tmp_path / "elsewhere")
    assert verify_snapshot(moved).ok
