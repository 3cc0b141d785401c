"""Launched probe of the harness (one launch per topology):

    timeout 300 $PY -m paddle.distributed.launch --nproc_per_node 4 --log_dir LOG \
        tests/multirank/probe_harness.py --mp 2 --pp 2 --out DIR [--gloo-checks]

Every rank: init fleet, build TinyParallelLlama, compare Paddle's ``model.sharded_state_dict()``
with the harness's ``sharded_state_dict(model)``, ``perturb(model, step)``, dump its shards to
``DIR/dump``; rank 0, after a barrier, reassembles and checks every tensor against
``expected_global`` bit for bit (and that the key set is the whole model). Each rank prints one line
``PROBE {json}``; rank 0 also ``REASSEMBLE {json}``. With ``--gloo-checks``, every rank then tries
all_gather / broadcast of uint8, float32, bfloat16 (global and mp group) and zero-copy byte views,
printing ``GLOO {json}``. Exit status non-zero if any harness check fails (gloo checks only report).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

T_START = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import harness  # noqa: E402


def gloo_checks(hcg) -> dict:
    import paddle
    import paddle.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    res = {}
    groups = {"global": None, "mp": hcg.get_model_parallel_group(), "pp": hcg.get_pipe_parallel_group()}

    def payload(dtype, r, n=4099):
        """Rank r's tensor: distinct bit patterns (odd length), and its expected bits in numpy."""
        if dtype == "uint8":
            bits = ((np.arange(n) * 7 + 31 * r) % 256).astype(np.uint8)
            return paddle.to_tensor(bits), bits
        vals = harness.expected_global(f"gloo/{r}", (n,), 0)  # exact in bf16
        t = paddle.to_tensor(vals)
        if dtype == "bfloat16":
            return t.astype("bfloat16"), harness.expected_global(f"gloo/{r}", (n,), 0, "bfloat16")
        return t, vals

    for dtype in ("uint8", "float32", "bfloat16"):
        for gname, g in groups.items():
            ranks = list(range(world)) if g is None else list(g.ranks)
            name = f"all_gather/{dtype}/{gname}"
            try:
                t, _ = payload(dtype, rank)
                t0 = time.perf_counter()
                outs = []
                dist.all_gather(outs, t, group=g)
                dt = time.perf_counter() - t0
                ok = len(outs) == len(ranks) and all(
                    harness.dtype_name(o) == dtype
                    and np.array_equal(harness.tensor_to_numpy_bits(o), payload(dtype, r)[1])
                    for o, r in zip(outs, ranks)
                )
                res[name] = {"ok": bool(ok), "s": round(dt, 4)}
            except Exception as e:  # noqa: BLE001
                res[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            name = f"broadcast/{dtype}/{gname}"
            try:
                src = ranks[-1]  # global rank
                t, _ = payload(dtype, rank)
                t0 = time.perf_counter()
                dist.broadcast(t, src=src, group=g)
                dt = time.perf_counter() - t0
                ok = harness.dtype_name(t) == dtype and np.array_equal(harness.tensor_to_numpy_bits(t), payload(dtype, src)[1])
                res[name] = {"ok": bool(ok), "s": round(dt, 4)}
            except Exception as e:  # noqa: BLE001
                res[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            dist.barrier()

    # bf16 shipped as its uint8 byte view (how an exporter could move any dtype), mp group
    try:
        t, _ = payload("bfloat16", rank)
        outs = []
        dist.all_gather(outs, t.view(paddle.uint8), group=groups["mp"])
        ok = all(
            np.array_equal(harness.tensor_to_numpy_bits(o.view(paddle.bfloat16)), payload("bfloat16", r)[1])
            for o, r in zip(outs, groups["mp"].ranks)
        )
        res["all_gather/bf16-as-uint8-view/mp"] = {"ok": bool(ok), "dtype_out": harness.dtype_name(outs[0])}
    except Exception as e:  # noqa: BLE001
        res["all_gather/bf16-as-uint8-view/mp"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    dist.barrier()

    # zero-copy views
    t = paddle.arange(12, dtype="float32").reshape([3, 4])
    v = t.view(paddle.uint8)
    res["view_uint8/float32"] = {"zero_copy": v.data_ptr() == t.data_ptr(), "shape": list(v.shape)}
    b = t.astype("bfloat16")
    vb = b.view(paddle.uint8)
    res["view_uint8/bfloat16"] = {"zero_copy": vb.data_ptr() == b.data_ptr(), "shape": list(vb.shape)}
    for label, src in (("float32", t), ("uint8-view-of-float32", v), ("uint8-view-of-bfloat16", vb), ("bfloat16", b)):
        try:
            a = np.from_dlpack(src)
            same = a.__array_interface__["data"][0] == src.data_ptr()
            res[f"np.from_dlpack/{label}"] = {"zero_copy": bool(same), "dtype": str(a.dtype), "shape": list(a.shape)}
        except Exception as e:  # noqa: BLE001
            res[f"np.from_dlpack/{label}"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    # a parameter's bytes through view + dlpack, and that writes show through
    p = paddle.create_parameter([2, 3], "float32")
    a = np.from_dlpack(p.detach().view(paddle.uint8))
    p.set_value(paddle.full([2, 3], 2.0))
    res["param->detach->view(uint8)->np.from_dlpack tracks set_value"] = bool(
        np.array_equal(a.view(np.float32).reshape(-1), np.full(6, 2.0, np.float32))
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    for ax in ("dp", "mp", "pp", "sharding", "sep"):
        ap.add_argument(f"--{ax}", type=int, default=1)
    ap.add_argument("--sharding-stage", type=int, default=1)
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gloo-checks", action="store_true")
    a = ap.parse_args()

    import paddle.distributed as dist

    t_import = time.perf_counter() - T_START
    hcg = harness.init_fleet(dp=a.dp, mp=a.mp, pp=a.pp, sharding=a.sharding, sep=a.sep, sharding_stage=a.sharding_stage)
    cfg = harness.harness_config()
    rank = dist.get_rank()
    failures = []

    t0 = time.perf_counter()
    model = harness.TinyParallelLlama()
    paddle_sd_before = model.sharded_state_dict()
    ref_sd = harness.sharded_state_dict(model)
    failures += [f"sharded_state_dict: {p}" for p in harness.compare_sharded_state_dicts(paddle_sd_before, ref_sd)]

    harness.perturb(model, a.step)
    sd = model.sharded_state_dict()
    # the dict taken before perturb must see the new values (same storage)
    for k, sw in paddle_sd_before.items():
        spec = model.param_specs[k]
        want = harness.expected_block(k, spec.global_shape, spec.global_offset, spec.local_shape, a.step)
        if not np.array_equal(harness.tensor_to_numpy_bits(sw.local_tensor), want):
            failures.append(f"{k}: local shard after perturb is not the expected block")
    dump_dir = os.path.join(a.out, "dump")
    harness.dump_shards(sd, dump_dir)
    t_model = time.perf_counter() - t0

    info = harness.rank_info(hcg)
    info.update(
        n_local=len(sd),
        local_keys_sample=sorted(sd)[:2] + sorted(sd)[-2:],
        stage_layers=model.layer_ids,
        local_shapes={k: [list(sw.local_shape), list(sw.global_offset)] for k, sw in sd.items()
                      if k.startswith(("model.embed_tokens", "lm_head", "model.layers." + str(model.layer_ids[0]) + ".self_attn.q_proj",
                                       "model.layers." + str(model.layer_ids[0]) + ".mlp.down_proj"))},
        groups_created=cfg["groups_created"],
        t_import=round(t_import, 2),
        t_fleet_init=round(cfg["fleet_init_seconds"], 2),
        t_model_perturb_dump=round(t_model, 3),
        failures=failures,
    )
    print("PROBE " + json.dumps(info), flush=True)

    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        try:
            full, count = harness.reassemble(dump_dir, return_coverage=True)
            shapes = harness.global_param_shapes()
            bad = []
            if set(full) != set(shapes):
                bad.append(f"key set differs: missing {sorted(set(shapes) - set(full))[:5]}, extra {sorted(set(full) - set(shapes))[:5]}")
            for k, arr in full.items():
                exp = harness.expected_global(k, shapes[k], a.step)
                if arr.shape != exp.shape or arr.dtype != exp.dtype or arr.tobytes() != exp.tobytes():
                    bad.append(f"{k}: reassembled differs from expected_global")
            # negative control: step a.step+1 must not match
            k0 = "model.layers.0.mlp.down_proj.weight"
            if np.array_equal(full[k0], harness.expected_global(k0, shapes[k0], a.step + 1)):
                bad.append("negative control matched")
            failures += bad
            print("REASSEMBLE " + json.dumps({
                "ok": not bad, "n_keys": len(full), "shards_per_key": sorted(set(count.values())),
                "problems": bad[:10], "t": round(time.perf_counter() - t0, 3)}), flush=True)
        except AssertionError as e:
            failures.append(f"reassemble: {e}")
            print("REASSEMBLE " + json.dumps({"ok": False, "error": str(e)}), flush=True)
    dist.barrier()

    if a.gloo_checks:
        try:
            print("GLOO " + json.dumps({"rank": rank, **gloo_checks(hcg)}), flush=True)
        except Exception:  # noqa: BLE001
            print("GLOO-CRASH " + traceback.format_exc().replace("\n", " | "), flush=True)
        dist.barrier()
    print(f"DONE rank={rank} failures={len(failures)} total={time.perf_counter() - T_START:.2f}s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
