"""Which decode GEMV a GGUF projection takes, and where its int8 activations are
quantized: the ``quant_int8*`` switches of :mod:`kernels.switches`, read at each call
(so a CUDA graph captured after a change takes it). Host-side, no Triton import.

- ``quant_int8`` (default on): Q4_K/Q6_K decode rows on the int8-activation GEMV
  (:mod:`kernels.quant.triton_int8`), else the float GEMV.
- ``quant_int8_fuse`` (default off): the GEMV quantizes its float rows as it reads them
  (one launch less, the same results at the same tiling, but every program rounds its
  slice again: a batch-1 step of the 8B Q4_K_M shape took 4.36 ms against 3.21 on the
  H200); else a launch of their own quantizes them first, its codes shared by the parts
  of a fused projection.
- ``quant_int8_parts`` (default on): a projection of a Q4_K and a Q6_K part (a Q4_K_M
  file's q/k over v) is one GEMV launch, else a launch a part.
- ``quant_int8_producer`` (default on): rows that a decoder's RMSNorm or SiLU-and-mul
  kernel writes are quantized by that kernel as it writes them
  (:mod:`kernels.norm.triton_kernel`, :mod:`kernels.activation.triton_kernel` with
  ``quantize=True``), where they are quantized apart at all.
"""

from __future__ import annotations

from kernels.switches import current

# The block types with an integer-dot GEMV (Q6_K_P: Q6_K repacked, kernels.quant.repack).
INT8_TYPES = ("Q4_K", "Q6_K", "Q6_K_P")


def uses_int8_dot(type_name: str, int8_dot: bool | None = None) -> bool:
    """Whether the GEMV of ``type_name`` runs on int8 activations: an
    :data:`INT8_TYPES` type and ``int8_dot``, or where None the ``quant_int8`` switch."""
    return type_name in INT8_TYPES and (current().quant_int8 if int8_dot is None else int8_dot)


def int8_parts_in_one_launch(type_names: list[str | None]) -> bool:
    """Whether the decode GEMVs of a projection whose parts (top to bottom) are of
    ``type_names`` (None: dense) run as one launch
    (:func:`kernels.quant.triton_int8.int8_gemv_parts`): two parts, both on the int8
    GEMV, and the ``quant_int8_parts`` switch on."""
    return (current().quant_int8_parts and len(type_names) == 2
            and all(t is not None and uses_int8_dot(t) for t in type_names))


def int8_quantize_apart() -> bool:
    """Whether int8-GEMV activations are quantized by a launch of their own before the
    GEMV (the default) rather than inside it (the ``quant_int8_fuse`` switch)."""
    return not current().quant_int8_fuse


def int8_from_producer() -> bool:
    """Whether int8-GEMV activations quantized apart are quantized by the kernel that
    writes them where it can (an RMSNorm, SiLU-and-mul: ``quantize=True``) rather than by
    a launch of their own (the ``quant_int8_producer`` switch)."""
    return current().quant_int8_producer and int8_quantize_apart()
