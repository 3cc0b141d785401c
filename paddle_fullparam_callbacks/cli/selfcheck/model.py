"""The selfcheck's model: a small stack of Paddle's own tensor-parallel layers, split over pipeline
stages, with values known in advance.

Every parameter's global values come from :func:`reference` (a function of its name only), so the
check needs nothing from the run to know what the snapshot must hold. Each rank builds only its
stage's blocks (named by global block index, as a pipeline stage names its layers) and writes into
each parameter the slice of the reference its sharded state dict says it holds. Sizes are chosen so
the embedding and the head are larger than the small device budget the selfcheck exports with.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Tuple

import numpy as np

VOCAB, HIDDEN, INTER, BLOCKS = 1024, 128, 256, 4


def global_shapes() -> Dict[str, Tuple[int, ...]]:
    """{parameter name: global shape} of the whole model (Paddle's [in, out] layout for linears)."""
    shapes = {"embed.weight": (VOCAB, HIDDEN)}
    for i in range(BLOCKS):
        shapes.update({f"blocks.{i}.up.weight": (HIDDEN, INTER), f"blocks.{i}.up.bias": (INTER,),
                       f"blocks.{i}.down.weight": (INTER, HIDDEN), f"blocks.{i}.norm": (HIDDEN,)})
    shapes["head.weight"] = (HIDDEN, VOCAB)
    return shapes


def reference(name: str, shape: Tuple[int, ...]) -> np.ndarray:
    """The global float32 values of parameter ``name``: random-looking, with every bfloat16 rounding
    case present (low mantissa bits set), from a seed of the name alone."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def stage_blocks(pp: int, stage: int) -> List[int]:
    """Global indices of the blocks on pipeline stage ``stage`` (a contiguous, even split)."""
    per = BLOCKS // pp
    return list(range(stage * per, (stage + 1) * per))


def build(hcg):
    """This rank's part of the model, built from Paddle's parallel layers, with the reference values."""
    import paddle
    from paddle import nn
    from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    class Block(nn.Layer):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(HIDDEN, INTER, has_bias=True, gather_output=False)
            self.down = RowParallelLinear(INTER, HIDDEN, has_bias=False, input_is_parallel=True)
            self.norm = self.create_parameter([HIDDEN], default_initializer=nn.initializer.Constant(1.0))

    class Stack(nn.Layer):
        def __init__(self, blocks: List[int], first: bool, last: bool):
            super().__init__()
            if first:
                self.embed = VocabParallelEmbedding(VOCAB, HIDDEN)
            self.blocks = nn.LayerDict({str(i): Block() for i in blocks})  # global names: blocks.<i>.*
            if last:
                self.head = ColumnParallelLinear(HIDDEN, VOCAB, has_bias=False, gather_output=False)

    pp, stage = hcg.get_pipe_parallel_world_size(), hcg.get_stage_id()
    model = Stack(stage_blocks(pp, stage), stage == 0, stage == pp - 1)
    shapes = global_shapes()
    with paddle.no_grad():
        for key, sw in model.sharded_state_dict().items():
            full = reference(key, shapes[key])
            box = tuple(slice(o, o + n) for o, n in zip(sw.global_offset, sw.local_shape))
            sw.local_tensor.set_value(paddle.to_tensor(np.ascontiguousarray(full[box]), place=sw.local_tensor.place))
    return model


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (finite values): computed here, not by Paddle,
    so the check of a bfloat16 export does not trust the cast it checks.

    >>> bfloat16_bits(np.array([1.0, 1.00390625, 1.01171875], np.float32)).tolist()  # ties go to even
    [16256, 16256, 16258]
    """
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
