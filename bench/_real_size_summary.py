"""``bench/real_size.py``'s figures from its phases' raw rows: the five measures, their targets, the checks.

Ratios are paired (the variants of one round ran minutes apart at most; the median of the per-round ratios) and
given beside the ratio of the medians. The async floor is the issue's: the snapshot bytes the ring cannot hold
at the disk's write rate (the raw ``pwrite`` + fsync of the same bytes, this run) plus the ring's fill at memcpy
speed (measured in the same process).
"""
from __future__ import annotations

import _common as C
import _real_size as R

TARGETS = {
    "live.ratio_vs_cp": ">= 0.8", "live.ratio_vs_save_pretrained": "> 1 (faster)", "live.peak_extra_rss": "<= 0.05x model",
    "live.seconds_per_byte_vs_0.67GB": "<= 1.3x", "fp8.time_ratio": "<= 1.15x bf16's",
    "async.stall_over_floor": "<= 1.2x the floor (where the ring cannot hold the snapshot)",
    "mp2.received_as_predicted": "each rank: the plan's bytes (+ at most 1 MiB of control messages)",
    "mp2.time_ratio": "< 1 (faster than one process)", "convert.ratio_vs_raw_copy": ">= 0.8",
    "convert.peak_extra_rss": "<= 0.05x checkpoint",
}
CONTROL_BYTES = 2**20  # decisions, statuses, the records exchange: what an export says besides the tensor bytes


def _med(xs):
    return round(C.median(xs), 4) if xs else None


def _paired(base, ours):
    """median of base/ours over rounds, and the ratio of the medians."""
    pairs = [round(b / o, 3) for b, o in zip(base, ours)]
    return {"median_paired": round(C.median(pairs), 3) if pairs else None, "all": pairs,
            "of_medians": round(C.median(base) / C.median(ours), 3) if base and ours else None}


def _live(single: dict, pf: dict, model: int) -> dict:
    runs = single["sync"]["runs"]
    sec = {v: [r["seconds"] for r in rs] for v, rs in runs.items()}
    snap = runs["bf16"][0]["bytes"]
    ref = single["ref"]
    ref_s_per_b = C.median([r["seconds"] for r in ref["runs"]]) / ref["runs"][0]["bytes"]
    out = {"seconds": {v: _med(s) for v, s in sec.items()}, "snapshot_bytes": snap,
           "gb_s": {v: round(snap / 1e9 / C.median(s), 3) for v, s in sec.items() if v != "fp8"},
           "ratio_vs_cp": _paired(sec["cp"], sec["bf16"]), "ratio_vs_raw": _paired(sec["raw"], sec["bf16"]),
           "peak_extra_rss_bytes": max(r["peak_extra_rss_bytes"] for r in runs["bf16"]),
           "ref_model_bytes": ref["model_bytes"], "ref_seconds": _med([r["seconds"] for r in ref["runs"]]),
           "seconds_per_byte_ratio_vs_ref": round(C.median(sec["bf16"]) / snap / ref_s_per_b, 3)}
    out["peak_extra_rss_fraction"] = round(out["peak_extra_rss_bytes"] / model, 4)
    if pf and pf.get("runs"):
        p = pf["runs"]
        out["save_pretrained"] = {"model_bytes": pf["model_bytes"], "layers": pf["layers"],
                                  "fits_at_this_size": pf["fits_at_full_size"],
                                  "needs_at_this_size_bytes": pf["needs_at_this_size_bytes"],
                                  "seconds": {v: _med([r["seconds"] for r in rs]) for v, rs in p.items()},
                                  "peak_extra_rss_bytes": {v: max(r["peak_extra_rss_bytes"] for r in rs) for v, rs in p.items()},
                                  "ratio": _paired([r["seconds"] for r in p["save_pretrained"]], [r["seconds"] for r in p["ours"]])}
    return out


def _fp8(single: dict, d: dict) -> dict:
    runs = single["sync"]["runs"]
    bf16_q = sum(R._numel(s) for n, s in R.shapes(d).items() if R.LINEAR.search(n)) * R.BF16
    f = runs["fp8"][0]
    return {"seconds": {"bf16": _med([r["seconds"] for r in runs["bf16"]]), "fp8": _med([r["seconds"] for r in runs["fp8"]])},
            "time_ratio": _paired([r["seconds"] for r in runs["fp8"]], [r["seconds"] for r in runs["bf16"]]),
            "bytes": {"bf16": runs["bf16"][0]["bytes"], "fp8": f["bytes"]},
            "bytes_ratio": round(f["tensor_bytes"] / runs["bf16"][0]["bytes"], 4),
            "quantized_bytes_ratio": round(f["quantized_part_bytes"] / bf16_q, 4),
            "peak_extra_rss_bytes": max(r["peak_extra_rss_bytes"] for r in runs["fp8"])}


def _async(single: dict) -> list:
    """Per case: the ring, the stall against the synchronous export's and against the floor of each export (its
    paired raw write's disk rate, this process's memcpy rate)."""
    runs = single["sync"]["runs"]
    snap = single["model_bytes"]  # the tensor bytes: what the ring would hold (the files' headers are not copied)
    copy = single["memcpy_gb_s"] * 1e9
    sync = C.median([r["seconds"] for r in runs["bf16"]])
    out = []
    for c in single["async"]:
        ring = min(c["ring_bytes"], snap)
        floors = [max(0, snap - ring) / (snap / raw) + ring / copy for raw in c["raw_s"]]
        stall = C.median(c["stalls_s"])
        out.append({"case": c["case"], "ring_bytes": c["ring_bytes"], "ring_holds_snapshot": c["ring_bytes"] >= snap,
                    "mem_available_before_ring_bytes": c["mem_available_before_bytes"],
                    "mem_available_after_ring_bytes": c["mem_available_after_ring_bytes"],
                    "mem_available_at_export_bytes": c["mem_available_at_export_bytes"],
                    "mem_available_low_bytes": c["mem_available_low_bytes"], "stall_s": round(stall, 4),
                    "stalls_s": c["stalls_s"], "sync_s": round(sync, 4), "stall_over_sync": round(stall / sync, 3),
                    "floors_s": [round(f, 4) for f in floors], "floor_s": round(C.median(floors), 4),
                    "stall_over_floor": round(C.median([s / f for s, f in zip(c["stalls_s"], floors)]), 3),
                    "disk_gb_s": [round(snap / 1e9 / r, 3) for r in c["raw_s"]], "memcpy_gb_s": single["memcpy_gb_s"],
                    "export_seconds": c["export_seconds"], "train_seconds": c["train_seconds"],
                    "peak_extra_rss_bytes": c["peak_extra_rss_bytes"]})
    return out


def _mp2(mp2: dict, single: dict) -> dict:
    ranks = mp2["ranks"]
    reps = len(ranks[0]["reps"])
    secs = [max(ranks[r]["reps"][i]["seconds"] for r in ranks) for i in range(reps)]
    per = {}
    for r, t in ranks.items():
        got = [x["kernel"]["received"] for x in t["reps"]]
        want = t["predicted"]["received"]
        per[r] = {"kernel_received": got, "predicted_received": want,
                  "session_plan_received": [x["plan_received"] for x in t["reps"]],
                  "kernel_sent": [x["kernel"]["sent"] for x in t["reps"]], "predicted_sent": t["predicted"]["sent"],
                  "excess_bytes": [g - want for g in got], "writes_bytes": t["predicted"]["writes"],
                  "local_bytes": t["local_bytes"], "build_seconds": t["build_seconds"],
                  "as_predicted": all(0 <= g - want <= CONTROL_BYTES for g in got)}
    sync = C.median([r["seconds"] for r in single["sync"]["runs"]["bf16"]]) if single else None
    return {"seconds": secs, "seconds_median": _med(secs), "single_process_seconds": sync,
            "time_ratio": round(C.median(secs) / sync, 3) if sync else None,
            "snapshot_bytes": ranks[0]["predicted"]["snapshot_bytes"], "per_rank": per}


def _convert(conv: dict, model: int) -> dict:
    runs = conv["runs"]
    peak = max(r["rss_extra"]["VmRSS"] for r in runs["convert"])
    return {"seconds": {v: _med([r["seconds"] for r in rs]) for v, rs in runs.items()},
            "ratio_vs_raw_copy": _paired([r["seconds"] for r in runs["raw_copy"]], [r["seconds"] for r in runs["convert"]]),
            "ratio_export_alone_vs_raw_copy": _paired([r["seconds"] for r in runs["raw_copy"]],
                                                      [r["timings"]["total_s"] for r in runs["convert"]]),
            "checkpoint_bytes": conv["checkpoint_bytes"], "peak_extra_rss_bytes": {
                k: max(r["rss_extra"][k] for r in runs["convert"]) for k in ("VmRSS", "RssAnon", "RssFile")},
            "peak_extra_rss_fraction": round(peak / conv["checkpoint_bytes"], 4),
            "prepare_s": [r["prepare_s"] for r in runs["convert"]]}


def _checks(res: dict) -> dict:
    ph = res["phases"]
    out = {}
    single = ph.get("single")
    if single:
        c = single["sync"]["checks"]
        out["bf16_first_tensor_by_tensor"] = c["bf16"][0]["ok"]
        out["bf16_later_same_bytes"] = all(x["ok"] for x in c["bf16"][1:])
        out["bf16_transformers_meta"] = c["hf_meta"]["ok"]
        out["fp8_first"] = c["fp8"][0]["ok"]
        out["fp8_later_same_bytes"] = all(x["ok"] for x in c["fp8"][1:])
        out["disturbed_tries_verified"] = all(x.get("ok", x.get("verify_ok")) for x in c.get("discarded", []))
        out["async_snapshots"] = all(x["ok"] for a in single["async"] for x in a["checks"])
        out["async_same_files_as_sync"] = all(a["checks"][0].get("same_files_as_sync") for a in single["async"])
        out["no_oom_kill_in_one_process"] = single["oom_kills_after"] == single["oom_kills_before"]
    if ph.get("convert"):
        out["convert_tensor_by_tensor_and_meta"] = ph["convert"]["checks"]["ok"]
    if ph.get("pf", {}).get("runs"):
        out["pf_phase_ours_verified"] = all(r["verify_ok"] for r in ph["pf"]["runs"]["ours"])
    if ph.get("mp2"):
        out["mp2_halves_verify_meta"] = ph["mp2"]["checks"]["ok"]
    cond = res["conditions"]
    out["no_oom_kill"] = cond["after"]["oom_kills"] == cond["before"]["oom_kills"]
    out["no_swap"] = not cond["after"]["swap_total_bytes"]
    return out


def summarize(res: dict) -> None:
    ph, d = res["phases"], res["dims"]
    model = R.model_bytes(d)
    table, met = {}, {}
    single = ph.get("single")
    if single:
        table["live"] = live = _live(single, ph.get("pf"), model)
        table["fp8"] = fp8 = _fp8(single, d)
        table["async"] = asy = _async(single)
        met["live.ratio_vs_cp"] = live["ratio_vs_cp"]["median_paired"] >= 0.8
        met["live.peak_extra_rss"] = live["peak_extra_rss_fraction"] <= 0.05
        met["live.seconds_per_byte_vs_0.67GB"] = live["seconds_per_byte_ratio_vs_ref"] <= 1.3
        if "save_pretrained" in live:
            met["live.ratio_vs_save_pretrained"] = live["save_pretrained"]["ratio"]["median_paired"] > 1
        met["fp8.time_ratio"] = fp8["time_ratio"]["median_paired"] <= 1.15
        for a in asy:
            if not a["ring_holds_snapshot"]:
                met[f"async.stall_over_floor.{a['case']}"] = a["stall_over_floor"] <= 1.2
    if ph.get("mp2"):
        table["mp2"] = mp2 = _mp2(ph["mp2"], single)
        met["mp2.received_as_predicted"] = all(r["as_predicted"] for r in mp2["per_rank"].values())
        if mp2["time_ratio"] is not None:
            met["mp2.time_ratio"] = mp2["time_ratio"] < 1
    if ph.get("convert"):
        table["convert"] = conv = _convert(ph["convert"], model)
        met["convert.ratio_vs_raw_copy"] = conv["ratio_vs_raw_copy"]["median_paired"] >= 0.8
        met["convert.peak_extra_rss"] = conv["peak_extra_rss_fraction"] <= 0.05
    res.update(table=table, targets=TARGETS, met=met, checks=_checks(res))


def print_table(res: dict) -> None:
    t = res["table"]
    print(f"\n{res['scale']}: {res['model_bytes'] / 1e9:.2f} GB ({res['dims']['num_hidden_layers']} layers, vocab "
          f"{res['dims']['vocab_size']}), {res['seconds']:.0f} s in all")
    if "live" in t:
        lv = t["live"]
        print(f"live: {lv['seconds']['bf16']} s ({lv['gb_s']['bf16']} GB/s); cp -r {lv['seconds']['cp']} s -> "
              f"{lv['ratio_vs_cp']['median_paired']}x; raw {lv['seconds']['raw']} s; peak extra RSS "
              f"{lv['peak_extra_rss_fraction']}x; s/byte {lv['seconds_per_byte_ratio_vs_ref']}x the 0.67 GB model's")
        if "save_pretrained" in lv:
            sp = lv["save_pretrained"]
            print(f"save_pretrained ({sp['model_bytes'] / 1e9:.2f} GB): {sp['seconds']} -> ours {sp['ratio']['median_paired']}x")
        f = t["fp8"]
        print(f"fp8: {f['seconds']} -> {f['time_ratio']['median_paired']}x bf16's time; bytes {f['bytes_ratio']}x, "
              f"quantized part {f['quantized_bytes_ratio']}x")
        for a in t["async"]:
            print(f"async {a['case']}: ring {a['ring_bytes'] / 1e9:.2f} GB, stall {a['stall_s']} s ({a['stall_over_sync']}x "
                  f"sync), floor {a['floor_s']} s -> {a['stall_over_floor']}x")
    if "mp2" in t:
        m = t["mp2"]
        print(f"mp2: {m['seconds_median']} s ({m['time_ratio']}x one process); received "
              + "; ".join(f"rank {r}: {v['kernel_received']} (plan {v['predicted_received']})" for r, v in m["per_rank"].items()))
    if "convert" in t:
        c = t["convert"]
        print(f"convert: {c['seconds']} -> {c['ratio_vs_raw_copy']['median_paired']}x raw copy; peak extra RSS "
              f"{c['peak_extra_rss_fraction']}x")
    for k, ok in res["met"].items():
        print(f"target {k}: {'met' if ok else 'MISSED'}")
    for k, ok in res["checks"].items():
        print(f"check {k}: {'ok' if ok else 'FAILED'}")
