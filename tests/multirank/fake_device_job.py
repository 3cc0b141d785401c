"""Rank script for tests/test_fake_device.py: collectives of the fake accelerator's communicator.

Run by ``paddle.distributed.launch --devices 0,..`` with the fake device's environment
(``tests/_fake_device.launch``). Every rank runs the same checks on known, rank-dependent values
and prints one line ``FAKEDEV {json}``: the values it received (the test compares them with what
it computes itself) and, for the dtype x reduction matrix, the combinations that came out wrong.

Options:
  --out DIR           scratch folder shared by the ranks (the barrier check)
  --base B            offset of every value (two jobs at once use different offsets)
  --fleet DPxMPxPP    initialise through fleet.init with these hybrid degrees (else init_parallel_env)
  --rendezvous PORT   after the communicator exists, connect to the test's rendezvous server on
                      127.0.0.1:PORT and wait for its byte, which it sends once every rank of
                      every job connected: the jobs' communicators provably coexist
  --failures          2 ranks: after the checks, rank 0 waits alone in an all_reduce with a 3 s
                      timeout, then in another communicator whose peer has exited
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--base", type=int, default=0)
p.add_argument("--fleet", default="")
p.add_argument("--rendezvous", type=int, default=0)  # a port
p.add_argument("--failures", action="store_true")
args = p.parse_args()
out_dir = Path(args.out)
B = args.base

paddle.set_device("fakedev")
hcg = None
if args.fleet:
    from paddle.distributed import fleet

    dp, mp, pp = (int(v) for v in args.fleet.split("x"))
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": mp, "pp_degree": pp}
    if pp > 1:
        strategy.pipeline_configs = {"accumulate_steps": 1, "micro_batch_size": 1}
    t0 = time.perf_counter()
    fleet.init(is_collective=True, strategy=strategy)
    fleet_init_s = time.perf_counter() - t0
    hcg = fleet.get_hybrid_communicate_group()
else:
    dist.init_parallel_env()

r, n = dist.get_rank(), dist.get_world_size()
report = {"rank": r, "world": n, "pid": os.getpid(), "place": str(paddle.get_device()),
          "backend": os.environ.get("PADDLE_DISTRI_BACKEND"), "selected": os.environ.get("FLAGS_selected_fakedevs")}


def on_device(a):
    return paddle.to_tensor(a, place=paddle.CustomPlace("fakedev", int(report["selected"])))


def host(t):
    """numpy of a tensor, bfloat16 as float32 values."""
    if t.dtype == paddle.bfloat16:
        t = t.astype("float32")
    return t.numpy()


# 1. all_gather of known values, several dtypes (the first one also creates the communicator)
gathered = {}
for name in ["float32", "bfloat16", "float16", "int64", "uint8", "int8"]:
    if name in ("float32", "float16", "bfloat16"):
        mine = on_device((B + 100 * r + np.arange(5)).astype(np.float32)).astype(name)
    elif name == "int64":
        mine = on_device(np.array([B * 10**12 + r, -r - 1, 2**40 + r], dtype=np.int64))
    else:
        mine = on_device((np.arange(4) * 7 + r + B % 97).astype(name))
    parts = []
    dist.all_gather(parts, mine)
    gathered[name] = [host(t).tolist() for t in parts]
    report["all_gather_place"] = str(parts[0].place)
report["all_gather"] = gathered

if args.rendezvous:
    with socket.create_connection(("127.0.0.1", args.rendezvous), timeout=240) as conn:
        assert conn.recv(1) == b"!", "the rendezvous server closed without releasing the ranks"

# 2. broadcast from the last rank
t = on_device((B + 1000 * r + np.arange(3)).astype(np.float32))
dist.broadcast(t, src=n - 1)
report["broadcast"] = host(t).tolist()

# 3. all_reduce: every dtype x {sum, max, min, prod}, checked here against numpy
ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PROD}
wrong, checked = [], 0


def values(rank, name):
    v = np.array([rank + 1, 3 * rank, 2, rank % 2, 5 - rank], dtype=np.float64)
    if name not in ("uint8",):
        v[1] = -v[1]
    return v


for name in ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]:
    for op_name, op in ops.items():
        everyone = np.stack([values(k, name) for k in range(n)])
        want = {"sum": everyone.sum(0), "max": everyone.max(0), "min": everyone.min(0),
                "prod": everyone.prod(0)}[op_name]
        x = on_device(values(r, name).astype(np.float32 if name == "bfloat16" else name))
        if name == "bfloat16":
            x = x.astype("bfloat16")
        dist.all_reduce(x, op=op)
        got = host(x).astype(np.float64)
        checked += 1
        if str(x.dtype).split(".")[-1] != name or not np.array_equal(got, want):
            wrong.append({"dtype": name, "op": op_name, "got": got.tolist(), "want": want.tolist()})
report["all_reduce_checked"] = checked
report["all_reduce_wrong"] = wrong

# a large all_reduce: several steps of the plugin's staging buffer
big = np.arange(300_000, dtype=np.float32) % 1000
x = on_device((big * (r + 1)).astype(np.float32))
dist.all_reduce(x)
report["all_reduce_big_ok"] = bool(np.array_equal(x.numpy(), big * sum(range(1, n + 1))))

# 4. barrier: every rank's file exists once the barrier returned
(out_dir / f"barrier.{B}.{r}").write_text("")
dist.barrier()
report["barrier_saw"] = sorted(int(f.name.split(".")[-1]) for f in out_dir.glob(f"barrier.{B}.*"))

# 5. reduce_scatter: rank r gets the sum over ranks k of k's block r
out = on_device(np.zeros(3, np.float32))
dist.reduce_scatter(out, [on_device(np.full(3, 10 * r + j + B, np.float32)) for j in range(n)])
report["reduce_scatter"] = out.numpy().tolist()

# 6. send/recv between pairs (even sends first), larger than one mailbox chunk
msg = (np.arange(50_000) + 100_000 * r + B).astype(np.float32)
peer = r + 1 if r % 2 == 0 else r - 1
buf = on_device(np.zeros(50_000, np.float32))
if r % 2 == 0:
    dist.send(on_device(msg), dst=peer)
    dist.recv(buf, src=peer)
else:
    dist.recv(buf, src=peer)
    dist.send(on_device(msg), dst=peer)
want = (np.arange(50_000) + 100_000 * peer + B).astype(np.float32)
report["send_recv_ok"] = bool(np.array_equal(buf.numpy(), want))
report["send_recv_head"] = buf.numpy()[:2].tolist()

# 7. a ring of isend/irecv in one batch (every rank sends before it receives: a group)
recv_t = on_device(np.zeros(50_000, np.float32))
tasks = dist.batch_isend_irecv([dist.P2POp(dist.isend, on_device(msg), (r + 1) % n),
                                dist.P2POp(dist.irecv, recv_t, (r - 1) % n)])
for task in tasks:
    task.wait()
want = (np.arange(50_000) + 100_000 * ((r - 1) % n) + B).astype(np.float32)
report["ring_ok"] = bool(np.array_equal(recv_t.numpy(), want))

# 8. objects
objs = []
dist.all_gather_object(objs, {"rank": r, "base": B, "pid": os.getpid()})
report["all_gather_object"] = objs
lst = [{"from": r, "base": B}, "x" * (r + 1)]
dist.broadcast_object_list(lst, src=0)
report["broadcast_object_list"] = lst

# 9. alltoall: rank r's j-th tensor goes to rank j
outs = []
dist.alltoall(outs, [on_device(np.array([10.0 * r + j + B], np.float32)) for j in range(n)])
report["alltoall"] = [float(o.numpy()[0]) for o in outs]

# 10. hybrid groups: all_gather in each, and a tensor-parallel forward against the dense result
if hcg is not None:
    report["fleet_init_s"] = round(fleet_init_s, 2)
    for axis, g in [("mp", hcg.get_model_parallel_group()), ("pp", hcg.get_pipe_parallel_group()),
                    ("dp", hcg.get_data_parallel_group())]:
        report[f"{axis}_ranks"] = list(g.ranks)
        if g.nranks > 1:
            parts = []
            dist.all_gather(parts, on_device(np.array([float(r + B)], np.float32)), group=g)
            report[f"{axis}_all_gather"] = [float(t.numpy()[0]) for t in parts]
    from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

    mp_rank, mp_n = hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()
    rng = np.random.default_rng(7)  # the same full weights on every rank
    w1, b1 = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    w2, b2 = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    xin = rng.standard_normal((3, 8)).astype(np.float32)
    col = ColumnParallelLinear(8, 16, has_bias=True, gather_output=False)
    row = RowParallelLinear(16, 8, has_bias=True, input_is_parallel=True)
    k = 16 // mp_n
    col.weight.set_value(w1[:, mp_rank * k:(mp_rank + 1) * k])
    col.bias.set_value(b1[mp_rank * k:(mp_rank + 1) * k])
    row.weight.set_value(w2[mp_rank * k:(mp_rank + 1) * k])
    row.bias.set_value(b2)
    y = row(col(on_device(xin)))
    report["tp_place"] = str(y.place)
    report["tp_max_err"] = float(np.abs(y.numpy() - ((xin @ w1 + b1) @ w2 + b2)).max())

report["memory_allocated"] = int(paddle.device.memory_allocated(f"fakedev:{report['selected']}"))
print("FAKEDEV " + json.dumps(report), flush=True)

if args.failures:
    assert n == 2
    lib = ctypes.CDLL(os.path.join(os.environ["CUSTOM_DEVICE_ROOT"], "libfakedev.so"))
    lib.fakedev_set_comm_timeout.argtypes = [ctypes.c_double]
    pair = dist.new_group([0, 1])
    dist.all_reduce(on_device(np.ones(1, np.float32)), group=pair)  # creates its communicator
    # rank 1 stays out of rank 0's collective until rank 0 gave up: it blocks reading a socket
    # that rank 0 serves (the port travels while the communicator still works)
    server = socket.create_server(("127.0.0.1", 0)) if r == 0 else None
    ports = []
    dist.all_gather_object(ports, server.getsockname()[1] if server else None)
    if r == 0:
        # (a) alone in a collective: fails after the timeout, with the plugin's message on stderr
        lib.fakedev_set_comm_timeout(3.0)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            dist.all_reduce(on_device(np.ones(1, np.float32)))
            failure = {"timeout_error": None}
        except Exception as e:  # noqa: BLE001 - the type is part of the report
            failure = {"timeout_error": type(e).__name__}
        failure["timeout_s"] = round(time.perf_counter() - t0, 2)
        failure["timeout_cpu_s"] = round(time.thread_time() - cpu0, 3)  # waiting must not spin
        server.settimeout(120)
        conn, _ = server.accept()
        conn.sendall(b"!")
        conn.close()
        # (b) the peer exits: the wait ends within about a second, whatever the timeout
        lib.fakedev_set_comm_timeout(120.0)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(on_device(np.ones(1, np.float32)), group=pair)
            failure["dead_peer_error"] = None
        except Exception as e:  # noqa: BLE001
            failure["dead_peer_error"] = type(e).__name__
        failure["dead_peer_s"] = round(time.perf_counter() - t0, 2)
        print("FAKEDEV_FAILURES " + json.dumps(failure), flush=True)
    else:
        with socket.create_connection(("127.0.0.1", ports[0]), timeout=120) as conn:
            conn.recv(1)
    # the communicators are broken on purpose: skip Paddle's teardown of them
    os._exit(0)
