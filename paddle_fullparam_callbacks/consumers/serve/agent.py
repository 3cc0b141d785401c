"""The swap agent: one process per training job that verifies each snapshot and offers it to every engine at
once, each through its protocol (``engines/``).

    python -I agent.py PACKAGE_ROOT     (started by the serving hook, ``hook.py``, in a session of its own)

It reads a work folder's path per line on stdin; the folder holds ``swap.json`` (``snapshot``, its path here;
``engine``, the protocol's name; ``api_key_env``, the variable that holds the key, read from this process's
environment, so the key is never written to disk; ``timeout_s``, ``reload_timeout_s``; ``log``; ``engines``:
``[{"url", "target": {"path", "version"}, "fallback": {"path", "version"} | null}]``, or in adapter mode
``[{"url", "adapter": {"path", "version", "names", "unload", "held"}}]``; ``verify``: ``snapshot`` or ``adapter``).
It verifies the snapshot (sizes, headers, every file's checksum; adapter mode: its adapter's files only; one that
fails is offered to no engine), swaps (or loads the adapter into) every engine in a thread of its own, writes
``output.json`` (``{"verified", "verify_s", "swaps": [Swap.as_dict(), ...]}``, atomically) and a line per engine to
``log``, then answers the path on stdout.

Why one long-lived process, started with the job: a snapshot reaches the engines in the time of the engines'
own calls (starting Python and importing the package cost more than a small model's reload, and are paid once,
before the first step), the verification's reading and hashing never compete with training for its GIL, and a
training job that is killed never leaves an engine paused: the agent, in its own session, finishes the swap it
started (then sees its input closed, and exits). SIGTERM is ignored for the same reason (every call is bounded
by its timeout). The protocols (``engines/``, standard library only) are imported by path.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

if __package__ in (None, ""):  # run by path (the hook's way): the protocols are beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from engines import Adapter, Swap, Target, engine_class  # noqa: E402
else:
    from .engines import Adapter, Swap, Target, engine_class

SPEC, OUTPUT, CURRENT = "swap.json", "output.json", "agent.json"


def swap_all(spec: dict, environ=os.environ, log=None) -> dict:
    """Every engine of ``spec`` swapped at once; ``{"swaps": [...], "seconds": s}`` in the spec's order."""
    cls = engine_class(spec.get("engine", "vllm"))
    key = environ.get(spec["api_key_env"]) if spec.get("api_key_env") else None
    t0 = time.perf_counter()
    out = [None] * len(spec["engines"])

    def one(i: int, e: dict) -> None:
        engine = cls(e["url"], key, spec["timeout_s"], spec["reload_timeout_s"])
        adapter = Adapter(**e["adapter"]) if e.get("adapter") else None
        version = adapter.version if adapter else e["target"]["version"]
        try:
            if adapter is not None:  # a LoRA run served as adapters: the base weights stay
                s = engine.load_adapter(adapter)
            else:
                s = engine.swap(Target(**e["target"]), Target(**e["fallback"]) if e.get("fallback") else None)
        except Exception as err:  # a defect of a protocol module: said, never a hang
            s = Swap(e["url"], error=f"the swap failed: {type(err).__name__}: {err}")
        s.seconds["swap_s"] = round(time.perf_counter() - t0, 4)
        s.seconds["done_unix"] = time.time()
        out[i] = s.as_dict()
        if log is not None:
            how = "ok" if s.ok else f"FAILED ({s.error})"
            names = f" as {', '.join(s.loaded)}" + (f", unloaded {', '.join(s.unloaded)}" if s.unloaded else "") \
                if adapter is not None else ""
            log(f"{e['url']}: {version}{names} {how}; serving {s.version or 'what it served before'} "
                f"{json.dumps(s.seconds)}")

    threads = [threading.Thread(target=one, args=(i, e), daemon=True) for i, e in enumerate(spec["engines"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"swaps": out, "seconds": round(time.perf_counter() - t0, 4)}


def write_atomic(path: str, obj: dict, durable: bool = True) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def verify(snapshot: str, verifiers, what: str = "snapshot") -> dict:
    """``what``: the whole snapshot, or one of its companions (``adapter``: the only files adapter mode's engines
    read, against the manifest's checksums; the weights are not read at all)."""
    verify_snapshot, verify_companion = verifiers
    t0 = time.perf_counter()
    if what == "snapshot":
        report = verify_snapshot(snapshot, mapped=True)  # this process's cores are idle while it waits
    else:
        report = verify_companion(snapshot, what)
    return {"verified": report.ok, "verify_s": round(time.perf_counter() - t0, 4), "verify_errors": report.errors[:5]}


def run_one(work: str, verifiers=None) -> None:
    """One job: the spec in ``work``, the output beside it, the log lines into the spec's ``log``."""
    write_atomic(os.path.join(work, CURRENT), {"pid": os.getpid()}, durable=False)
    with open(os.path.join(work, SPEC)) as f:
        spec = json.load(f)
    lock = threading.Lock()
    with open(spec.get("log") or os.devnull, "a") as logf:
        def log(line: str) -> None:
            with lock:
                logf.write(line + "\n")
                logf.flush()

        try:
            checked = verify(spec["snapshot"], verifiers, spec.get("verify") or "snapshot") \
                if verifiers and spec.get("snapshot") else {}
            if checked and not checked["verified"]:
                result = {**checked, "swaps": []}
                log(f"{spec['snapshot']} failed verification, offered to no engine: {'; '.join(checked['verify_errors'])}")
            else:
                result = {**checked, **swap_all(spec, log=log)}
        except Exception as err:  # a spec this agent cannot read: said in the output, never a hang
            result = {"swaps": [], "error": f"{type(err).__name__}: {err}"}
            log(f"the swap failed: {result['error']}")
    write_atomic(os.path.join(work, OUTPUT), result)


def main() -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    verifiers = None
    if len(sys.argv) > 1:  # the package's verification, imported now: before the job's first step, not at a swap
        sys.path.insert(0, sys.argv[1])
        from paddle_fullparam_callbacks.export.verify import verify_companion, verify_snapshot

        verifiers = (verify_snapshot, verify_companion)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        work = line.strip()
        if not work:
            continue
        run_one(work, verifiers)
        sys.stdout.write(work + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
