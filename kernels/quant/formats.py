"""GGUF block formats the quantized kernels read, and the bytes a tensor takes.

A quantized weight ``[N, K]`` is stored as ``N`` rows of ``K / block_elements`` blocks,
each ``block_bytes`` long (the GGUF tensor's own bytes, unchanged). Every supported
block splits into sub-blocks of ``sub_elements`` consecutive elements that share one
scale and one offset; the kernels work sub-block by sub-block. Layouts follow
ggml's ``block_q4_0`` ... ``block_q6_K`` and ``block_mxfp4`` (ggml-common.h), as decoded
by ``gguf.quants``.

Sizes come from ``gguf.GGML_QUANT_SIZES`` (elements per block, bytes per block), so
the loader and the memory plan charge exactly what the file holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type the kernels read.

    Attributes:
        name: the GGML type name (``"Q4_K"``).
        code: small integer the Triton kernels specialize on.
        block_elements: weights per block (32, or 256 for K-quants).
        block_bytes: bytes per block.
        sub_elements: consecutive weights sharing one scale and offset.
    """

    name: str
    code: int
    block_elements: int
    block_bytes: int
    sub_elements: int

    @property
    def subs_per_block(self) -> int:
        return self.block_elements // self.sub_elements

    @property
    def qtype(self) -> gguf.GGMLQuantizationType:
        """The GGML type whose blocks these are (a repacked layout's source type)."""
        return gguf.GGMLQuantizationType[REPACKED_FROM.get(self.name, self.name)]


def _fmt(name: str, code: int, sub: int) -> BlockFormat:
    elements, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    return BlockFormat(name, code, elements, nbytes, sub)


# Sub-block lengths: Q4_0/Q4_1/Q5_0/Q5_1 split their 32 weights into the low and high
# nibbles of 16 bytes; Q8_0 is one run of 32; Q4_K/Q5_K have 8 scales of 32 weights,
# Q6_K 16 scales of 16.
FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        _fmt("Q4_0", 0, 16),
        _fmt("Q4_1", 1, 16),
        _fmt("Q5_0", 2, 16),
        _fmt("Q5_1", 3, 16),
        _fmt("Q8_0", 4, 32),
        _fmt("Q4_K", 5, 32),
        _fmt("Q5_K", 6, 32),
        _fmt("Q6_K", 7, 16),
    )
}

# Block types only the routed experts are kept in (the fused MoE over blocks,
# :mod:`kernels.moe.quant_triton_kernel`, and the C kernels on the CPU read them; a
# projection of one is dequantized at load): MXFP4, gpt-oss's experts, one E8M0 scale
# byte and 16 bytes of E2M1 codes (low nibbles weights 0-15, high 16-31), split as Q4_0's.
EXPERT_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (_fmt("MXFP4", 9, 16),)}


# Layouts the loader repacks a GGML type into on CUDA: the same bytes in another order
# (:mod:`kernels.quant.repack`), so the kernels read them with aligned wide loads.
# ``Q6_K_P``: Q6_K's 210-byte blocks (2-byte aligned) as four planes per row.
REPACKED: dict[str, BlockFormat] = {"Q6_K_P": BlockFormat("Q6_K_P", 8, 256, 210, 16)}
REPACKED_FROM: dict[str, str] = {"Q6_K_P": "Q6_K"}


def block_format(name: str) -> BlockFormat:
    """The format of GGML type ``name`` (:data:`FORMATS` or the experts' :data:`EXPERT_FORMATS`),
    or of a repacked layout (:data:`REPACKED`).

    Raises:
        ValueError: the type is not one the kernels read (the message lists those).
    """
    for formats in (FORMATS, REPACKED, EXPERT_FORMATS):
        if name in formats:
            return formats[name]
    raise ValueError(f"GGUF type {name} is not kept quantized; supported: {', '.join({**FORMATS, **EXPERT_FORMATS})}")


def tensor_bytes(type_name: str, shape: tuple[int, ...], dense_itemsize: int) -> int:
    """Device bytes of one GGUF tensor as the quantized loader places it.

    Args:
        type_name: the tensor's GGML type name.
        shape: its shape, outermost first (``[N, K]`` for a weight).
        dense_itemsize: bytes per element when the tensor is not kept quantized (the
            model dtype's size).

    Returns:
        ``N * K / block_elements * block_bytes`` for a supported block type, else
        ``numel * dense_itemsize``.

    Raises:
        ValueError: a quantized shape whose last dimension is not whole blocks.
    """
    numel = 1
    for d in shape:
        numel *= int(d)
    fmt = FORMATS.get(type_name) or REPACKED.get(type_name) or EXPERT_FORMATS.get(type_name)
    if fmt is None:
        return numel * dense_itemsize
    if int(shape[-1]) % fmt.block_elements:
        raise ValueError(f"{type_name} tensor of shape {tuple(shape)}: rows are not whole blocks")
    return numel // fmt.block_elements * fmt.block_bytes
