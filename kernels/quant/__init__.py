"""GGUF block-quantized weights kept in their block format on the device.

:mod:`kernels.quant.formats` describes the block layouts and their sizes,
:mod:`kernels.quant.reference` is the plain-torch reference (``gguf``'s own
dequantizers, then a matmul), :mod:`kernels.quant.triton_kernel` holds the Triton
dequantize-GEMV (decode rows) and dequantize-to-tiles GEMM (prefill), and
:mod:`kernels.quant.triton_int8` an opt-in Q4_K/Q6_K GEMV on int8 activations.
"""
