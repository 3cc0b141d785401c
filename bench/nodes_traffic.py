"""Two nodes joined by a 1 Gbit/s link: what the seed and routed schedules send across it, and how long
the export takes against the link's floor.

Run as root (needs ``ip netns`` and ``tc``; the machine should otherwise be idle)::

    PY=$(scripts/env.sh paddleformers)
    PYTHONPATH=$PWD $PY bench/nodes_traffic.py --size full     # -> bench/results/nodes_traffic.json + a table
    PYTHONPATH=$PWD $PY bench/nodes_traffic.py --size small --reps 2 --out /tmp/nodes.json   # a quick look

The link: two network namespaces joined by a veth pair (``ip link add ... type veth peer ...``), each
end shaped with ``tc qdisc ... tbf rate 1gbit burst 512kb latency 200ms``, addresses 10.231.0.1/24 and
10.231.0.2/24 (checked to be unused on this machine; no route anywhere else); the namespaces are deleted
at the end, also on failure or SIGTERM. Without root or ``ip netns`` the JSON says so instead of figures.

Each case is one job of 4 ranks over two ``paddle.distributed.launch --nnodes 2 --master 10.231.0.1:PORT
--rank R --host <own address> --nproc_per_node 2`` launches, one per namespace under ``ip netns exec``,
with ``GLOO_SOCKET_IFNAME`` set to its veth; ranks 0, 1 on node A, 2, 3 on node B; each launch is one pod
(its own ``POD_NAME``), which is how the routed schedule numbers nodes (``trainer/topology.py``
``node_identity``): the ranks report the node numbers their plan used. Cases: ``mp2xpp2`` (the two
pipeline stages on the two nodes) and ``dp2xmp2`` (the two data-parallel replicas on the two nodes).
Inside, ``bench/assembler_ranks.py`` runs the variants ``seed`` and ``routed`` (``--variants``; ``paddle``
can be added) with ``--iface <veth>``: around each assembly (opening barrier .. closing barrier) every
rank reads its namespace's veth counters (``/sys/class/net/<veth>/statistics/{rx,tx}_bytes``: frames,
headers included); a node's window is its ranks' earliest reading before and latest after.

Reported per case and variant: bytes A->B and B->A on the link (median over repetitions), the TCP
payload the ranks counted (``ss``), the assembler's and the plan's cross-node counts, the export's
seconds (the slowest rank's, median) and the link's floor: max(A->B, B->A) / 125 MB/s (each direction
of a full-duplex 1 Gbit/s link carries 125 MB/s).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common as C  # noqa: E402

RESULT_PATH = C.RESULTS_DIR / "nodes_traffic.json"
LINK_BYTES_PER_S = 125e6  # 1 Gbit/s, one direction
SUBNET = "10.231.0"
ADDRS = (f"{SUBNET}.1", f"{SUBNET}.2")
VETHS = ("pfcv0", "pfcv1")
PORT = 29431  # inside fresh namespaces: nothing else listens there
STORE_ABORT = "uv__finish_close"
CASES = {
    "mp2xpp2": dict(nproc=4, mp=2, pp=2),  # stage 0 = ranks 0, 1 = node A; stage 1 = node B
    "dp2xmp2": dict(nproc=4, dp=2, mp=2),  # replica 0 = ranks 0, 1 = node A; replica 1 = node B
}


def sh(*cmd, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=check, timeout=60)


def unavailable_reason() -> str:
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command on this machine"
    r = sh("ip", "netns", "list", check=False)
    if r.returncode != 0:
        return f"'ip netns' does not work here: {r.stderr.strip()}"
    r = sh("ip", "-o", "addr", check=False)
    if f" {SUBNET}." in r.stdout:
        return f"{SUBNET}.0/24 is already in use on this machine: refusing to add namespaces with it"
    return ""


class Link:
    """Two namespaces joined by a shaped veth pair; ``close()`` deletes them (idempotent)."""

    def __init__(self, rate: str):
        tag = f"{os.getpid()}"
        self.ns = (f"pfcA{tag}", f"pfcB{tag}")
        self.created = []
        self.rate = rate

    def __enter__(self) -> "Link":
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
            sh("ip", "link", "add", VETHS[0], "netns", self.ns[0], "type", "veth", "peer", "name", VETHS[1],
               "netns", self.ns[1])
            for ns, veth, addr in zip(self.ns, VETHS, ADDRS):
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                sh("ip", "-n", ns, "link", "set", veth, "up")
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", self.rate,
                   "burst", "512kb", "latency", "200ms")
        except BaseException:
            self.close()
            raise
        return self

    def describe(self) -> dict:
        out = {}
        for ns, veth in zip(self.ns, VETHS):
            out[ns] = {"addr": sh("ip", "-n", ns, "-o", "addr", "show", "dev", veth, check=False).stdout.split()[3:4],
                       "routes": sh("ip", "-n", ns, "route", check=False).stdout.strip().splitlines(),
                       "qdisc": sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", veth, check=False).stdout.strip()}
        return out

    def close(self) -> None:
        for ns in reversed(self.created):
            sh("ip", "netns", "del", ns, check=False)  # the veth pair goes with its namespaces
        self.created = []

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(proc) -> str:
    out = ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            out, _ = proc.communicate(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    return out or ""


def run_case(link: Link, name: str, spec: dict, size: str, reps: int, variants: str, timeout: float,
             max_shard: str, procs: list) -> dict:
    import assembler

    args = ["--case", name, "--variants", variants, *assembler.case_args(spec, size, reps, max_shard)]
    for attempt in range(2):
        work = Path(tempfile.mkdtemp(prefix=f"pfc_bench_nodes_{name}_"))
        logs = [work / f"node{n}" for n in (0, 1)]
        t0 = time.perf_counter()
        procs.clear()
        for n in (0, 1):
            cmd = ["ip", "netns", "exec", link.ns[n], "env", f"GLOO_SOCKET_IFNAME={VETHS[n]}", sys.executable, "-m",
                   "paddle.distributed.launch", "--master", f"{ADDRS[0]}:{PORT}", "--nnodes", "2", "--rank", str(n),
                   "--host", ADDRS[n], "--nproc_per_node", str(spec["nproc"] // 2), "--log_dir", str(logs[n]),
                   str(BENCH / "assembler_ranks.py"), *args, "--iface", VETHS[n]]
            logs[n].mkdir(parents=True)
            procs.append(subprocess.Popen(cmd, cwd=str(logs[n]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        outputs, timed_out = [], False
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))[0] or "")
            except subprocess.TimeoutExpired:
                timed_out = True
                outputs.append(_stop(p))
        rcs = [p.returncode for p in procs]
        procs.clear()
        texts = {f"{n}/{f.name}": f.read_text(errors="replace") for n in (0, 1) for f in logs[n].glob("workerlog.*")}
        tagged = [json.loads(line[len("ASMBENCH "):]) for t in texts.values() for line in t.splitlines()
                  if line.startswith("ASMBENCH ")]
        if not timed_out and all(rc == 0 for rc in rcs) and len(tagged) == spec["nproc"]:
            break
        if attempt == 0 and any(STORE_ABORT in t for t in [*outputs, *texts.values()]):
            continue
        tails = "\n".join(f"--- {k}\n{v[-3000:]}" for k, v in sorted(texts.items()))
        raise RuntimeError(f"case {name}: launch failed (rc {rcs}, timed out {timed_out})\n"
                           + "\n".join(o[-2000:] for o in outputs) + "\n" + tails)
    seconds = time.perf_counter() - t0
    per_rank = {d["rank"]: d for d in tagged}
    case = assembler.summarize_case(per_rank, seconds, str(work))
    node_of = {r: (0 if r < spec["nproc"] // 2 else 1) for r in per_rank}
    case["nodes_seen_by_the_plan"] = {r: d["nodes"] for r, d in sorted(per_rank.items())}
    case["pods"] = {r: d["pod"] for r, d in sorted(per_rank.items())}
    case["link"] = {}
    for v, e in case["variants"].items():
        if "not_run" in e:
            continue
        nrep = min(len(per_rank[r]["variants"][v]["reps"]) for r in per_rank)
        per_rep = []
        for i in range(nrep):
            node = {}
            for n in (0, 1):
                reps = [per_rank[r]["variants"][v]["reps"][i] for r in per_rank if node_of[r] == n]
                node[n] = {k: max(x["iface_after"][k] for x in reps) - min(x["iface_before"][k] for x in reps)
                           for k in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}
            slowest = max(per_rank[r]["variants"][v]["reps"][i]["seconds"] for r in per_rank)
            a_to_b, b_to_a = node[0]["tx_bytes"], node[1]["tx_bytes"]
            per_rep.append({"a_to_b_bytes": a_to_b, "b_to_a_bytes": b_to_a, "a_rx_bytes": node[0]["rx_bytes"],
                            "b_rx_bytes": node[1]["rx_bytes"], "packets": node[0]["tx_packets"] + node[1]["tx_packets"],
                            "seconds": slowest, "link_floor_seconds": max(a_to_b, b_to_a) / LINK_BYTES_PER_S})
        med = lambda k: C.median([x[k] for x in per_rep]) if per_rep else None  # noqa: E731
        ranks = e["per_rank"]
        plan_cross = [x.get("predicted_received_cross_node") for x in ranks.values()]
        own_cross = [x.get("own_received_cross_node") for x in ranks.values()]
        case["link"][v] = {
            "a_to_b_bytes": med("a_to_b_bytes"), "b_to_a_bytes": med("b_to_a_bytes"),
            "crossing_bytes": (med("a_to_b_bytes") or 0) + (med("b_to_a_bytes") or 0),
            "median_seconds": e["median_seconds"], "link_floor_seconds": med("link_floor_seconds"),
            "seconds_over_link_floor": (e["median_seconds"] / med("link_floor_seconds")) if med("link_floor_seconds") else None,
            "predicted_cross_node_bytes": sum(plan_cross) if all(x is not None for x in plan_cross) else None,
            "own_cross_node_bytes": sum(own_cross) if all(x is not None for x in own_cross) else None,
            "kernel_payload_received": e["total"]["kernel_received"],
            "per_rep": per_rep,
        }
    return case


def print_table(result: dict) -> None:
    if result.get("unavailable"):
        print("not measured:", result["unavailable"])
        return
    for name, c in result["cases"].items():
        print(f"== {name} (snapshot {c['snapshot_bytes'] / 2**20:.2f} MiB; nodes seen by the plan "
              f"{sorted({tuple(v) for v in c['nodes_seen_by_the_plan'].values()})})")
        for v, l in c["link"].items():
            print(f"  {v:7} A->B {l['a_to_b_bytes'] / 2**20:8.2f} MiB  B->A {l['b_to_a_bytes'] / 2**20:8.2f} MiB  "
                  + (f"planned cross {l['predicted_cross_node_bytes'] / 2**20:8.2f} MiB  "
                     if l["predicted_cross_node_bytes"] is not None else f"planned cross {'-':>8}      ")
                  + f"{l['median_seconds']:.3f} s vs link floor {l['link_floor_seconds']:.3f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default=C.tiny("small", "tiny"), choices=("tiny", "small", "full"))
    # tiny mode (bench/_common.py): the cases differ in the mesh only
    ap.add_argument("--cases", default=C.tiny(",".join(CASES), "mp2xpp2"))
    ap.add_argument("--variants", default="seed,routed")
    ap.add_argument("--reps", type=int, default=C.tiny(3, 1))
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate of each veth end")
    ap.add_argument("--max-shard-size", default="")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULT_PATH))
    ns = ap.parse_args()

    t0 = time.perf_counter()
    result = {"benchmark": "nodes_traffic", "date": C.now_iso(), "git": C.git_commit(), "machine": C.machine_info(),
              "size": ns.size, "reps": ns.reps, "rate": ns.rate}
    reason = unavailable_reason()
    if reason:
        result["unavailable"] = reason
        C.write_json(Path(ns.out), result)
        print_table(result)
        return
    procs: list = []
    link = Link(ns.rate)

    def cleanup(*_):
        for p in procs:
            _stop(p)
        link.close()

    atexit.register(cleanup)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(128 + 15))
    try:
        with link:
            result["link"] = link.describe()
            result["cases"] = {}
            for name in ns.cases.split(","):
                print(f"case {name} ({ns.size}) ...", file=sys.stderr, flush=True)
                result["cases"][name] = run_case(link, name, CASES[name], ns.size, ns.reps, ns.variants, ns.timeout,
                                                 ns.max_shard_size, procs)
    finally:
        cleanup()
    left = [n for n in link.ns if n in sh("ip", "netns", "list", check=False).stdout]
    result["namespaces_removed"] = not left
    result["notes"] = [
        "a_to_b_bytes / b_to_a_bytes: the veth's tx_bytes on node A / B (frames: TCP/IP/Ethernet headers included) "
        "from the opening barrier to the closing one (gloo barrier bytes included), median over repetitions.",
        "link_floor_seconds = max(a_to_b, b_to_a) / 125 MB/s (1 Gbit/s each way, full duplex); median_seconds: "
        "the slowest rank's assembly (stream_tensors, no writer), median over repetitions.",
        "predicted_cross_node_bytes: the routed plan's received_cross_node summed over ranks; own_cross_node_bytes: "
        "the routed assembler's count. Nodes are the launches' pods (POD_NAME differs per launch): "
        "nodes_seen_by_the_plan lists ctx.nodes as each rank saw it.",
        "2 shared cores for 4 ranks: seconds are noisy; the byte counts are not.",
    ]
    result["total_seconds"] = time.perf_counter() - t0
    C.write_json(Path(ns.out), result)
    print_table(result)
    print(f"wrote {ns.out} in {result['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
