"""Run by tests/test_install.py inside a copy of the checkout, through that copy's Makefile: the code
imported by pytest, by a subprocess started elsewhere (as tests/_helpers.run_cli starts the CLI) and by a
rank of ``paddle.distributed.launch`` (as the multi-rank tests start theirs) is this copy's.

Not collected by ``make test`` (the name does not start with ``test_``); it writes what each process saw
to ``$PFC_PROBE_OUT`` as JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPORT = ("import json, paddle_fullparam_callbacks as m; "
          "print('PROBE ' + json.dumps([m.__file__, getattr(m, 'CHECKOUT_MARK', None)]))")


def _probe(out: str, err: str = "") -> list:
    lines = [ln for ln in out.splitlines() if ln.startswith("PROBE ")]
    assert lines, f"the process did not report what it imported:\n{out[-2000:]}\n{err[-2000:]}"
    return json.loads(lines[0][len("PROBE "):])


def test_every_process_imports_this_checkout(tmp_path):
    import paddle_fullparam_callbacks as m

    seen = {"pytest": [m.__file__, getattr(m, "CHECKOUT_MARK", None)]}
    proc = subprocess.run([sys.executable, "-c", REPORT], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seen["subprocess"] = _probe(proc.stdout, proc.stderr)
    rank = tmp_path / "rank.py"
    rank.write_text(REPORT + "\n")
    proc = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "1", "--log_dir",
                           str(tmp_path / "log"), str(rank)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "log" / "workerlog.0").read_text() if (tmp_path / "log" / "workerlog.0").exists() else proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
    seen["launch"] = _probe(log, proc.stderr)
    Path(os.environ["PFC_PROBE_OUT"]).write_text(json.dumps({"root": str(ROOT), "seen": seen}))
    own = str((ROOT / "paddle_fullparam_callbacks" / "__init__.py").resolve())
    assert {k: str(Path(f).resolve()) for k, (f, _) in seen.items()} == dict.fromkeys(seen, own), seen
