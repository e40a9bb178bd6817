"""Compile the fused MoE over GGUF blocks (``kernels/moe/quant_triton_kernel.py``) for a
Hopper GPU (sm_90) without one, and report register spills: the grouped GEMV (gated
gate/up, weighted down) and the sorted GEMM (bfloat16; Q4_K decoded as the packed GEMM
decodes it) for a Q4_K_M file's types (Q4_K gate and up, Q6_K down) and one legacy type (Q8_0), each alone and over an expert
cache's slots, and gpt-oss's MXFP4 experts with their biases and clamped SwiGLU.

Run as a script in its own process, as ``triton_quant_compile_check.py`` (whose compile
helper it uses): the interpreter accepts code the compiler refuses. Prints one line per
variant; exits non-zero on a failure or a spill.
"""

from __future__ import annotations

import sys

from triton_quant_compile_check import _compile  # noqa: I001 - drops TRITON_INTERPRET before triton loads

from kernels.moe import quant_triton_kernel as triton_moe_quant
from kernels.quant.triton_packed_gemm import PACKED_TYPES

_SCALARS = ("num_rows", "top_k", "N", "K", "a_expert_bytes", "b_expert_bytes", "a_row_bytes", "b_row_bytes",
            "stride_xm", "stride_om")


def main() -> int:
    failures = 0
    for gate_up, down, gpt_oss in ((("Q4_K", "Q4_K"), "Q6_K", False), (("Q8_0", "Q8_0"), "Q8_0", False),
                                   (("MXFP4", "MXFP4"), "MXFP4", True)):
        for gated, types in ((True, gate_up), (False, (down, down))):
            consts = {**triton_moe_quant._prefixed("A", types[0]), **triton_moe_quant._prefixed("B", types[1]),
                      "GATED": gated, "WEIGHTED": not gated, "BIASED": gpt_oss, "CLAMPED": gpt_oss and gated}
            pointers = {"X": "*bf16", "Wa": "*u8", "Wb": "*u8", "Out": "*bf16", "RouteWeights": "*bf16"}
            scalars = dict.fromkeys(_SCALARS, "i32")
            sort = {"SortedRows": "*i32", "BlockExperts": "*i32", "NumPadded": "*i32"}
            tiers = {"SlotOf": "*i64", "a_cache_delta": "i64", "b_cache_delta": "i64", "Bias": "*bf16",
                     "bias_stride": "i64", "bias_up": "i64", "alpha": "fp32", "limit": "fp32"}
            gemv = {**pointers, "TopkIds": "*i64", **tiers, **scalars}
            gemm = {**pointers, **sort, **tiers, **scalars}
            variants = [(f"{name}{' over a cache' if cached else ''}", fn, args, {"CACHED": cached, **tiling}, warps)
                        for cached in ((False,) if gpt_oss else (False, True))  # biased experts are never cached
                        for name, fn, args, tiling, warps in (
                            ("gemv", triton_moe_quant._moe_gemv_kernel, gemv, {"BLOCK_N": 4, "ASM": True}, 4),
                            ("gemm", triton_moe_quant._moe_gemm_kernel, gemm,
                             {"BLOCK_M": 64, "BLOCK_N": 64, "IEEE": False, "ASM": True,
                              "A_PACKED": types[0] in PACKED_TYPES, "B_PACKED": gated and types[1] in PACKED_TYPES},
                             8))]
            for name, fn, args, tiling, warps in variants:
                regs, frame, _ = _compile(fn, args, {**consts, **tiling}, warps)
                print(f"moe {name} {'/'.join(types)} {'gate/up' if gated else 'down'}: {regs} registers, "
                      f"{frame} B stack")
                failures += frame > 0
    print("moe quant kernels ok" if not failures else f"{failures} variants spill registers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
