"""Paddle tensor -> host numpy array with the bytes the writer needs, copying as little as possible."""
from __future__ import annotations

import numpy as np

from .. import _dtypes


def to_host_array(tensor) -> np.ndarray:
    """A numpy array over the tensor's bytes (bfloat16 as uint16 bits).

    A CPU tensor is shared, not copied (DLPack), strides included: a transposed view stays a
    view, and the writer copies it block by block. A GPU tensor is copied to host once.
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    import paddle

    if not tensor.place.is_cpu_place():
        tensor = tensor.cpu()
    if not tensor.stop_gradient:
        # Paddle refuses DLPack on tensors that require grad; detach() shares the memory
        tensor = tensor.detach()
    dt = _dtypes.lookup(str(tensor.dtype))
    try:
        if dt.name == "bfloat16":
            arr = np.from_dlpack(tensor.view(paddle.uint16))
        else:
            arr = np.from_dlpack(tensor)
        if arr.dtype == np.dtype(dt.np_storage) and tuple(arr.shape) == tuple(tensor.shape):
            return arr
    except (TypeError, RuntimeError, ValueError, BufferError, AttributeError):
        pass
    arr = tensor.numpy()  # copies; always right
    if arr.dtype != np.dtype(dt.np_storage):
        arr = arr.view(dt.np_storage)
    return arr
