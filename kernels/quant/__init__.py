"""GGUF block-quantized weights kept in their block format on the device.

- :mod:`kernels.quant.formats`: the block layouts and their sizes;
  :mod:`kernels.quant.repack`: Q6_K rearranged into aligned planes for the GPU;
  :mod:`kernels.quant.synthetic`: random blocks for tests and benchmarks.
- :mod:`kernels.quant.reference`: the plain-torch reference (``gguf``'s own
  dequantizers, then a matmul; the int8 arithmetic's reference too).
- :mod:`kernels.quant.triton_decode`: the Triton block decoder and K loops every block
  kernel shares (this folder's and :mod:`kernels.moe.quant_triton_kernel`);
  :mod:`kernels.quant.triton_kernel`: the dequantize-GEMV (decode rows) and
  dequantize-to-tiles GEMM (prefill), ``quant_matmul`` choosing between them.
- The int8-activation GEMV for Q4_K/Q6_K decode rows: :mod:`kernels.quant.int8_choice`
  (whether it runs and where its activations are quantized: the ``quant_int8*``
  switches), :mod:`kernels.quant.triton_activations` (the activations rounded to int8,
  by a launch of their own or by the norm/SiLU kernel that writes them),
  :mod:`kernels.quant.triton_int8_dot` (its per-step decoding and dot products) and
  :mod:`kernels.quant.triton_int8` (the kernel and its launch).
"""
