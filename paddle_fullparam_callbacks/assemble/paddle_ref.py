"""Adapter that runs Paddle's own ``full_param`` instead of the builtin assembler (cross-checks).

Selected with ``assembler: paddle``. Single process it uses Paddle's single-card path; the
multi-rank HV path takes the groups this package derives.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import numpy as np

from .arrays import cast_for_export, to_paddle
from .device import dtype_of, host_array


def run_paddle_full_param(sharded_state_dict, aoa_config, export_dtype: str = "keep", transforms=None,
                          **group_kwargs) -> Iterator[Tuple[str, object]]:
    """``transforms`` (source key -> fn of the local slice, a LoRA merge): applied to every such slice
    before ``full_param`` runs, so all transformed slices are held at once (a cross-check, not the
    bounded path of the builtin assemblers). Paddle's ``full_param`` assembles where the parameters
    are: parameters on an accelerator are refused when the export is planned (``planning.py``)."""
    import copy

    import paddle
    from paddle.distributed.flex_checkpoint.dcp.full_param import full_param

    with paddle.no_grad():
        if transforms:
            sharded_state_dict = dict(sharded_state_dict)
            for key, fn in transforms.items():
                if key in sharded_state_dict:
                    sw = sharded_state_dict[key] = copy.copy(sharded_state_dict[key])
                    dtype = dtype_of(sw.local_tensor)
                    sw.local_tensor = to_paddle(np.asarray(fn(host_array(sw.local_tensor), dtype)), dtype)  # (a lazy merge: computed)
        for name, tensor in full_param(sharded_state_dict, aoa_config=aoa_config or {}, **group_kwargs):
            yield name, cast_for_export(host_array(tensor), dtype_of(tensor), export_dtype)
