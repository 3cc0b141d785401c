"""Shared fixtures. `tests/test_pf_*` need PaddleFormers and run in its environment,
`tests/test_pnlp_*` need PaddleNLP and run in its own (the Makefile picks the files);
everything else runs in both."""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the project is not installed into the shared environments (two clones would test each other's
# code): every process a test starts (CLI runs, launched ranks, the zoo's halves) imports this
# checkout, also when pytest was started without PYTHONPATH
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and Path(p).resolve() != ROOT]])
# convert's model descriptions (convert/described.py) go to a folder of this test run, never the user's cache: the
# first conversion of a model builds it from its class, later ones of the same model read it (both paths tested)
if "PADDLE_FULLPARAM_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PADDLE_FULLPARAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="pfc-test-cache-")


def pytest_collection_modifyitems(session, config, items):
    """Long files first, for pytest-xdist's workers (``tests/_schedule.py``); the tests of a file keep their order."""
    from _schedule import longest_first  # tests/ is on sys.path: pytest put it there to import this conftest

    items[:] = [items[i] for i in longest_first([item.nodeid for item in items])]


# Every test's setup and call get a time limit (PFC_TEST_TIMEOUT_S, default 600 s; the slowest test
# takes about 100 s here): a hang fails that test, with every thread's stack on stderr, and the suite
# goes on, instead of eating CI's 90 minutes in silence. A watchdog thread signals the main thread
# (SIGUSR2; SIGALRM is left to the tests that use it), so a blocking wait() or sleep is interrupted.
TEST_TIMEOUT_S = float(os.environ.get("PFC_TEST_TIMEOUT_S", "600"))


class TestTimeout(Exception):
    __test__ = False  # not a test class


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _time_limit(item, "setup"):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _time_limit(item, "call"):
        yield


_armed = {"what": None}  # the phase a late signal may still interrupt, or None


def _on_timeout(signum, frame):
    what = _armed["what"]
    if what is not None:  # a signal that arrives after its phase ended is ignored
        _armed["what"] = None
        raise TestTimeout(f"{what} ran longer than {TEST_TIMEOUT_S:g} s (PFC_TEST_TIMEOUT_S); "
                          "the stacks of every thread are above, on stderr")


class _time_limit:
    def __init__(self, item, phase: str):
        self.what = f"{item.nodeid} ({phase})"
        self.timer = None

    def __enter__(self):
        if TEST_TIMEOUT_S <= 0 or threading.current_thread() is not threading.main_thread():
            return self
        if signal.getsignal(signal.SIGUSR2) is not _on_timeout:
            signal.signal(signal.SIGUSR2, _on_timeout)

        def fire():
            if _armed["what"] != self.what:
                return
            sys.stderr.write(f"\n== {self.what}: over {TEST_TIMEOUT_S:g} s, the stacks of its threads:\n")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)

        _armed["what"] = self.what
        self.timer = threading.Timer(TEST_TIMEOUT_S, fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        if self.timer is not None:
            _armed["what"] = None
            self.timer.cancel()
        return False


@pytest.fixture(scope="session")
def hf_python() -> str:
    """Interpreter of the real-client environment (torch + transformers), created if needed."""
    path = os.environ.get("PFC_HF_PYTHON")
    if not path:
        path = subprocess.run(
            ["bash", str(ROOT / "scripts" / "env.sh"), "hf"], check=True, capture_output=True, text=True
        ).stdout.strip()
    return path


@pytest.fixture(scope="session")
def llama_cpp_converter(hf_python) -> str:
    """llama.cpp's ``convert_hf_to_gguf.py`` (from llama-cpp-python's pinned sdist, fetched once by
    ``scripts/llama_cpp.sh``), to run with ``hf_python``. A fetch that fails makes the test fail."""
    run = subprocess.run(["bash", str(ROOT / "scripts" / "llama_cpp.sh"), "--python", hf_python],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail(f"llama.cpp's converter could not be fetched:\n{run.stderr}", pytrace=False)
    return run.stdout.strip()


@pytest.fixture(scope="session")
def fake_device() -> Path:
    """Folder of the fake accelerator plugin (built if needed, see `tests/_fake_device.py`). A build
    that fails makes the test fail, never skip."""
    from _fake_device import FakeDeviceError, build

    try:
        return build()
    except FakeDeviceError as e:
        pytest.fail(f"the fake accelerator could not be built:\n{e}", pytrace=False)
