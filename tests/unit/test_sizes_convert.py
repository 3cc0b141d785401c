"""convert's checkpoint reads on both sides of their sizes (issue 46), against numpy's slicing of the whole tensor.

``convert/checkpoints/_reads.py`` reads a region's rows with ``preadv`` where the runs it can read are at least
``_MIN_RUN_BYTES`` (else from a populated mapping), batches at most ``_IOV_MAX`` segments per call, and lets one
region of ``GATED_BYTES`` or more be mapped at a time. Here a tensor of random shape and dtype is cut into a random
grid of stored blocks (C or Fortran order each, at random offsets in their files), and a random region is read the
ways the writer reads it (row blocks of any size, transposed or not, on two threads) with every one of those sizes
drawn from 1 to past the region, into poisoned buffers.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from paddle_fullparam_callbacks.convert.checkpoints import Checkpoint, FileSlice, TensorInfo, region
from paddle_fullparam_callbacks.convert.checkpoints import _reads
from paddle_fullparam_callbacks.convert.checkpoints._base import check_tiling
from paddle_fullparam_callbacks.host.copy import row_blocks
from paddle_fullparam_callbacks.host.poison import fresh, poisoned
from paddle_fullparam_callbacks.host.pool import WorkerPool, using

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _sizes import SETTINGS, shrunk  # noqa: E402

_POOL = WorkerPool(2)
DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float64": np.float64, "int8": np.int8}


def _cuts(draw, n: int) -> list:
    inner = draw(st.lists(st.integers(1, n - 1), max_size=3, unique=True)) if n > 1 else []
    return [0] + sorted(inner) + [n]


@st.composite
def reads(draw):
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    r_cuts, c_cuts = _cuts(draw, rows), _cuts(draw, cols)
    blocks = [(a, b, c, d) for a, b in zip(r_cuts, r_cuts[1:]) for c, d in zip(c_cuts, c_cuts[1:])]
    lo = (draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1)))
    shape = (draw(st.integers(0, rows - lo[0])), draw(st.integers(1, cols - lo[1])))
    if draw(st.booleans()):  # whole rows: a block's rows are file-adjacent runs, read in batches of _IOV_MAX
        lo, shape = (lo[0], 0), (shape[0], cols)
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    item = np.dtype(DTYPES[dtype]).itemsize
    return dict(rows=rows, cols=cols, blocks=blocks, fortran=[draw(st.booleans()) for _ in blocks],
                pads=[draw(st.integers(0, 9)) for _ in blocks], lo=lo, shape=shape, dtype=dtype,
                min_run=draw(st.sampled_from((1, item, draw(st.integers(1, cols * item * 2 + 8))))), iov=draw(st.integers(1, 4)),
                gated=draw(st.integers(1, rows * cols * item + 8)), transposed=draw(st.booleans()),
                block_bytes=draw(st.sampled_from((1, 2**30, draw(st.integers(1, rows * cols * item + 8))))), seed=draw(st.integers(0, 2**32 - 1)))


def _checkpoint(folder: Path, full: np.ndarray, dtype: str, case) -> Checkpoint:
    slices = []
    for i, ((r0, r1, c0, c1), fortran, pad) in enumerate(zip(case["blocks"], case["fortran"], case["pads"])):
        block = full[r0:r1, c0:c1]
        f = folder / f"{i}.bin"
        f.write_bytes(b"\x5a" * pad + block.tobytes(order="F" if fortran else "C"))
        slices.append(FileSlice(f, (r0, c0), block.shape, full.dtype.name, pad, fortran))  # (its storage dtype)
    info = TensorInfo(full.shape, dtype, slices)
    check_tiling("w", info)
    return Checkpoint(folder, "paddleformers", "flex", {"w": info}, None, {}, 1, [])


@SETTINGS
@given(reads())
def test_regions_read_at_any_size(case):
    rng = np.random.default_rng(case["seed"])
    storage = DTYPES[case["dtype"]]
    full = rng.integers(-100, 100, (case["rows"], case["cols"])).astype(storage)
    (r, c), (n, m) = case["lo"], case["shape"]
    want = full[r:r + n, c:c + m]
    with tempfile.TemporaryDirectory() as folder, poisoned(case["seed"]), using(_POOL), \
            shrunk(_reads, _MIN_RUN_BYTES=case["min_run"], _IOV_MAX=case["iov"], GATED_BYTES=case["gated"]):
        lazy = region(_checkpoint(Path(folder), full, case["dtype"], case), "w", (r, c), (n, m))
        if case["transposed"]:
            lazy, want = lazy.T, want.T
        got = fresh(np.empty(want.shape, storage))
        blocks = list(row_blocks(lazy, case["block_bytes"]))

        def fill(r0, r1):
            buf = fresh(np.empty((r1 - r0,) + tuple(want.shape[1:]), storage))  # the writer's pool buffer
            lazy.rows(r0, r1).fill(buf)
            got[r0:r1] = buf

        _POOL.run([(lambda a, b: lambda: fill(a, b))(a, b) for a, b in blocks])
        whole = np.array(lazy, copy=True)  # np.asarray: a view of the mapping, or assembled from the blocks
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(whole, want)


def test_preadv_batches_that_do_not_divide_the_rows():
    """Tensor-parallel column blocks read as whole rows: each block's rows are file-adjacent runs, read in batches
    of ``_IOV_MAX`` segments; 2, 3 and 5 do not divide its 16 rows (nor 1 the runs' minimum): every row arrives."""
    base = dict(rows=16, cols=6, blocks=[(0, 16, 0, 3), (0, 16, 3, 6)], fortran=[False, False], pads=[3, 0],
                lo=(0, 0), shape=(16, 6), dtype="float32", min_run=1, gated=1, transposed=False, block_bytes=2**30)
    for iov in (1, 2, 3, 5, 16, 17):
        test_regions_read_at_any_size.hypothesis.inner_test({**base, "iov": iov, "seed": iov})


def test_the_tiling_check_on_both_sides_of_its_grid_limit():
    """``_base._MAX_GRID_CELLS``: a tiling whose slices cut the tensor into more cells than that is refused by name,
    one at the limit is checked (and a gap in it found)."""
    from paddle_fullparam_callbacks.convert.checkpoints import CheckpointError, _base

    full = np.zeros((6, 4), np.float32)
    cuts = [(r, r + 2, c, c + 2) for r in (0, 2, 4) for c in (0, 2)]  # 3 x 2 = 6 cells
    slices = [FileSlice(Path(f"{i}.bin"), (r0, c0), (r1 - r0, c1 - c0), "float32", 0, False)
              for i, (r0, r1, c0, c1) in enumerate(cuts)]
    with shrunk(_base, _MAX_GRID_CELLS=6):
        check_tiling("w", TensorInfo(full.shape, "float32", slices))
        try:
            check_tiling("w", TensorInfo(full.shape, "float32", slices[:-1]))
        except CheckpointError as e:
            assert "no slice covers the block at [4, 2]" in str(e), e
        else:
            raise AssertionError("a missing slice passed the check")
    with shrunk(_base, _MAX_GRID_CELLS=5):
        try:
            check_tiling("w", TensorInfo(full.shape, "float32", slices))
        except CheckpointError as e:
            assert "'w'" in str(e) and "too many to check" in str(e), e
        else:
            raise AssertionError("a grid past the limit was checked")
