"""One process on the fake accelerator, for tests/test_fake_device.py (run with
``_fake_device.device_env(count=3, memory_mb=64)``). Prints ``FAKEDEV_SINGLE {json}``: round trips,
allocator statistics, the out-of-memory error and which ops run, fall back or fail on the device.
The test compares the values with what it computes itself."""
from __future__ import annotations

import json
import re

import numpy as np
import paddle

MB = 1 << 20
DEV = "fakedev:0"
report = {"types": paddle.device.get_all_custom_device_type(),
          "available": paddle.device.get_available_custom_device()}
paddle.set_device(DEV)
place = paddle.CustomPlace("fakedev", 0)

# round trips of known values (bit patterns, so NaN and -0.0 count)
f32 = np.array([0.0, -0.0, 1.5, -2.25, 3.4e38, 1e-45, np.inf, np.nan], dtype=np.float32)
t = paddle.to_tensor(f32, place=place)
report["f32_place"] = str(t.place)
report["f32_bits"] = t.numpy().view(np.uint32).tolist()
report["f32_cpu_bits"] = t.cpu().numpy().view(np.uint32).tolist()
bf = paddle.to_tensor(f32[:6], place=place).astype("bfloat16")  # the cast runs on the device
report["bf16_place"] = str(bf.place)
report["bf16_bits"] = bf.cpu().numpy().view(np.uint16).tolist()
report["bf16_back"] = bf.astype("float32").numpy().tolist()
i64 = np.array([0, -1, 2**62 + 7, -(2**63), 2**63 - 1], dtype=np.int64)
report["i64"] = paddle.to_tensor(i64, place=place).numpy().tolist()
second = paddle.to_tensor(f32, place=paddle.CustomPlace("fakedev", 2))
report["second_device_place"] = str(second.place)
report["device_to_device"] = str(t._copy_to(paddle.CustomPlace("fakedev", 1), True).place)

# allocator statistics (Paddle's own): exact, rounded up to the plugin's 256-byte alignment
alloc = lambda: int(paddle.device.memory_allocated(DEV))  # noqa: E731
before = alloc()
one_mib = paddle.empty([MB // 4], dtype="float32")
report["delta_1mib"] = alloc() - before
odd = paddle.empty([250_001], dtype="float32")  # 1_000_004 bytes
report["delta_odd"] = alloc() - before - report["delta_1mib"]
report["peak_after_two"] = int(paddle.device.max_memory_allocated(DEV)) - before
del one_mib, odd
report["back_to_before"] = alloc() - before
report["peak_kept"] = int(paddle.device.max_memory_allocated(DEV)) - before
paddle.device.reset_max_memory_allocated(DEV)
report["peak_after_reset"] = int(paddle.device.max_memory_allocated(DEV)) - before

# out of memory: FAKEDEV_MEMORY_MB=64 for this process
keep = paddle.empty([10 * MB // 4], dtype="float32")
cached = paddle.empty([20 * MB // 4], dtype="float32")
del cached  # 20 MB stays reserved (cached by Paddle's allocator) until an allocation needs it
report["reserved_with_cache"] = int(paddle.device.memory_reserved(DEV))
allocated_before_oom = alloc()
try:
    paddle.empty([60 * MB // 4], dtype="float32")
    report["oom"] = None
except MemoryError as e:
    msg = str(e)
    report["oom"] = "MemoryError"
    report["oom_says"] = [s for s in ("Out of memory error on fakedev:0", "Cannot allocate 60.000000MB") if s in msg]
    avail = re.search(r"available memory is only ([0-9.]+)MB", msg)
    report["oom_available_mb"] = float(avail.group(1)) if avail else None
report["reserved_after_oom"] = int(paddle.device.memory_reserved(DEV))
report["allocated_after_oom"] = alloc() - allocated_before_oom
fits = paddle.empty([50 * MB // 4], dtype="float32")  # 10 + 50 <= 64: fits once the cache is gone
report["after_oom_fits"] = str(fits.place)
del fits, keep

# ops: which run on the device (falling back to CPU kernels), what they allocate, which fail
x = paddle.to_tensor(np.arange(6, dtype=np.float32).reshape(2, 3), place=place)
w = paddle.to_tensor(np.ones((3, 2), dtype=np.float32), place=place)
b16 = x.astype("bfloat16")


def backward():
    lin = paddle.nn.Linear(3, 2)
    lin(x).sum().backward()
    return lin.weight.grad


ops = {
    "matmul": lambda: paddle.matmul(x, w),
    "add": lambda: x + x,
    "softmax": lambda: paddle.nn.functional.softmax(x),
    "sum": lambda: x.sum(),
    "randn": lambda: paddle.randn([2, 3]),
    "linear_init": lambda: paddle.nn.Linear(3, 4).weight,
    "backward": backward,
    "clone": lambda: x.clone(),
    "concat": lambda: paddle.concat([x, x]),
    "split": lambda: paddle.split(x, 3, axis=1)[1],
    "reshape": lambda: x.reshape([3, 2]),
    "slice": lambda: x[:, 1:],
    "transpose": lambda: x.T,
    "contiguous": lambda: x.T.contiguous(),
    "transpose_cpu": lambda: x.T.cpu(),
    "transpose_numpy": lambda: x.T.numpy(),
    "transpose_matmul": lambda: paddle.matmul(x.T, x),
    "cast_bf16": lambda: x.astype("bfloat16"),
    "concat_bf16": lambda: paddle.concat([b16, b16]),
    "slice_bf16": lambda: b16[:, 1:],
    "scale_bf16": lambda: b16 * 2,
    "sum_bf16": lambda: b16.sum(),
    "add_bf16": lambda: b16 + b16,
    "matmul_bf16": lambda: paddle.matmul(b16, b16, transpose_y=True),
}
facts = {}
for name, fn in ops.items():
    a = alloc()
    try:
        out = fn()
        facts[name] = {"ok": True, "alloc": alloc() - a,
                       "place": str(out.place) if hasattr(out, "place") else "numpy"}
        if hasattr(out, "is_contiguous"):
            facts[name]["contiguous"] = bool(out.is_contiguous())
        del out
    except Exception as e:  # noqa: BLE001 - the failure is the fact
        facts[name] = {"ok": False, "error": type(e).__name__, "says": str(e).strip().splitlines()[0][:160]}
report["ops"] = facts
report["matmul_value"] = paddle.matmul(x, w).numpy().tolist()

# without stride kernels, transpose is a CPU-fallback kernel that allocates a contiguous copy
paddle.set_flags({"FLAGS_use_stride_kernel": False})
a = alloc()
tt = x.T
report["no_stride_transpose"] = {"alloc": alloc() - a, "contiguous": bool(tt.is_contiguous()),
                                 "place": str(tt.place), "value": tt.cpu().numpy().tolist()}
print("FAKEDEV_SINGLE " + json.dumps(report), flush=True)
