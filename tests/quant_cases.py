"""Random GGUF blocks and activations for the quantized kernels' tests
(``test_quant_kernels.py``, ``test_int8_gemv_kernels.py``, ``gpu/test_quant_gpu.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.quant.formats import block_format
from kernels.quant.synthetic import random_blocks

# How far the int8 GEMV may land from the exact product, as a share of the largest
# output: the activations are rounded to int8 per 32 values (error up to amax / 254 of
# each group); measured up to 1.8% on these random blocks, whose mins make every
# weight of a sub-block share a large offset.
INT8_ROUNDING_TOL = 0.05


def quant_case(type_name: str, m: int, n: int, blocks_k: int, dev: str, dtype=torch.float32, seed: int = 0):
    """``(x, w)`` on ``dev``: ``m`` rows of ``blocks_k`` blocks of standard-normal activations
    (``dtype``), and ``n`` rows of random ``type_name`` blocks (``uint8``, the file's bytes)."""
    fmt = block_format(type_name)
    k = blocks_k * fmt.block_elements
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(random_blocks(type_name, n, k, rng)).to(dev)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32)).to(dtype).to(dev)
    return x, w
