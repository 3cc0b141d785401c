"""transformers' own ``Fp8Quantize`` on weights the tests give, in the real-client environment (no Paddle).

    python fp8_quantize.py IN.npz OUT.npz

``IN.npz``: for each case ``NAME``, the weight ``NAME`` (float32, or bfloat16 bits as uint16) and its block
``NAME.block``. ``OUT.npz``: ``NAME.q`` (the float8_e4m3fn bytes as uint8) and ``NAME.inv``
(``weight_scale_inv``). transformers passes a weight whose dimensions are not multiples of the block
through unquantized; such a weight is padded with zeros to the next multiples first (a zero never changes
a block's ``max_abs``), and the result cut back: the layout's partial edge blocks.
"""
import sys
import types

import numpy as np
import torch
from transformers.integrations.finegrained_fp8 import Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config


def main():
    data = np.load(sys.argv[1])
    out = {}
    for name in data.files:
        if name.endswith(".block"):
            continue
        w, block = data[name], tuple(int(b) for b in data[name + ".block"])
        t = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) if w.dtype == np.uint16 else torch.from_numpy(w)
        rows, cols = t.shape
        padded = torch.zeros((-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]), dtype=t.dtype)
        padded[:rows, :cols] = t
        rule = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=block)))
        res = rule.convert({"w.weight": padded})
        out[name + ".q"] = res["w.weight"].view(torch.uint8)[:rows, :cols].numpy()
        out[name + ".inv"] = res["w.weight_scale_inv"].numpy()
    np.savez(sys.argv[2], **out)


if __name__ == "__main__":
    main()
