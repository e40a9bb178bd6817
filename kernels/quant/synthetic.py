"""Random GGUF blocks with finite scales, for kernel tests and benchmarks.

Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 come from ``gguf.quants.quantize`` of random weights (the
package has quantizers for those); K-quant blocks are random bytes whose float16
scale fields are overwritten with small finite values (``gguf`` has no K-quant
quantizer, and random scale bytes would hold infinities and NaNs). A repacked layout
(``Q6_K_P``) is its source type's random blocks, repacked.
"""

from __future__ import annotations

import gguf.quants
import numpy as np
import torch

from kernels.quant.formats import REPACKED_FROM, block_format
from kernels.quant.repack import to_layout

# Byte offsets of the float16 fields of each K-quant block (ggml-common.h).
_K_FLOAT16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, *, scale: float = 1e-2) -> np.ndarray:
    """``[rows, cols / block_elements * block_bytes]`` uint8 blocks of type ``type_name``.

    ``scale`` bounds the float16 scale fields of K-quant blocks (their weights are up to
    about ``63 * 15 * scale``); the other types quantize normal weights of std 1.
    """
    if type_name in REPACKED_FROM:  # a layout the loader repacks into: the source type's blocks, repacked
        source = random_blocks(REPACKED_FROM[type_name], rows, cols, rng, scale=scale)
        return to_layout(torch.from_numpy(source), type_name).numpy()
    fmt = block_format(type_name)
    if type_name not in _K_FLOAT16_FIELDS:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        return gguf.quants.quantize(w, fmt.qtype)
    nblocks = rows * cols // fmt.block_elements
    raw = rng.integers(0, 256, size=(nblocks, fmt.block_bytes), dtype=np.uint8)
    for off in _K_FLOAT16_FIELDS[type_name]:
        d = (rng.uniform(-scale, scale, size=nblocks)).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(rows, cols // fmt.block_elements * fmt.block_bytes)
