"""Compile every Triton kernel of ``kernels/`` for a Hopper GPU (sm_90) without one.

Run as a script in its own process (Triton's mode is fixed at import, and the test
session imports it in interpreter mode). The interpreter accepts things the compiler
refuses (a float literal promoted to float64 in one branch of an ``if``, say), and only
the compiled code shows how the arithmetic was lowered: the PTX of the rotary kernel
must hold no bfloat16 FMA, which would round once where the eager ops round three
times. Prints one line per kernel; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.activation import triton_kernel as triton_activation
from kernels.attention import triton_kv_store
from kernels.gemv import triton_kernel as triton_gemv
from kernels.moe import triton_kernel as triton_moe
from kernels.norm import triton_kernel as triton_norm
from kernels.rotary import triton_kernel as triton_rotary
from kernels.sampling import triton_kernel as triton_sampling

TARGET = GPUTarget("cuda", 90, 32)


def _p(t: str) -> str:
    return "*" + t


def _compile(fn, args: list[tuple[str, str]], constexprs: dict) -> str:
    signature = dict(args) | {name: "constexpr" for name in constexprs}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
    return kernel.asm["ptx"]


def main() -> int:
    bf = "bf16"
    quant = [("q_ptr", _p("i8")), ("d_ptr", _p("fp32")), ("s_ptr", _p("i32"))]
    quant_strides = [("stride_q", "i32"), ("stride_d", "i32"), ("stride_s", "i32")]
    # With and without the output quantized for the int8 GEMV (QUANT), at a hidden size
    # of 4096 and an intermediate size's 1024-column programs (an 8B model's).
    for q in (False, True):
        ptx = _compile(triton_norm._rms_norm_kernel,
                 [("x_ptr", _p(bf)), ("res_ptr", _p(bf)), ("w_ptr", _p(bf)), ("out_ptr", _p(bf)), *quant,
                  ("stride_x", "i32"), ("stride_res", "i32"), ("stride_out", "i32"), *quant_strides, ("H", "i32"),
                  ("eps", "fp32")],
                 {"HAS_RESIDUAL": True, "QUANT": q, "BLOCK": 4096, "PDL": 1})
        # Programmatic dependent launch (kernels.pdl): the wait, then the early launch.
        if not ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx):
            print("rms_norm: PDL=1 compiled without griddepcontrol.wait/launch_dependents")
            return 1
    print("rms_norm ok")
    for q in (False, True):
        _compile(triton_activation._silu_and_mul_kernel,
                 [("x_ptr", _p(bf)), ("out_ptr", _p(bf)), *quant, ("stride_x", "i32"), ("stride_out", "i32"),
                  *quant_strides, ("inter", "i32")],
                 {"QUANT": q, "BLOCK": 1024, "PDL": 1})
    print("silu_and_mul ok")
    for gated in (False, True):
        ptx = _compile(triton_gemv._gemv_kernel,
                       [("X", _p(bf)), ("W", _p(bf)), ("Out", _p(bf)), ("M", "i32"), ("N", "i32"),
                        ("stride_xm", "i32"), ("stride_wn", "i32"), ("stride_om", "i32")],
                       {"K": 576, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "GATED": gated, "F32_DOT": False})
        if "fma.rn.bf16" in ptx:
            print("gemv: the compiler fused bfloat16 products into FMAs (rounds unlike eager torch)")
            return 1
    print("gemv ok")
    for dt, precision in ((bf, "tf32"), ("fp32", "ieee")):
        for gated, gpt_oss in ((False, False), (True, False), (False, True), (True, True)):
            ptx = _compile(triton_moe._grouped_gemm_kernel,
                           [("A", _p(dt)), ("W", _p(dt)), ("Out", _p(dt)), ("RouteWeights", _p("fp32")),
                            ("SortedRows", _p("i32")), ("BlockExperts", _p("i32")), ("NumPadded", _p("i32")),
                            ("Bias", _p(dt)), ("bias_stride", "i32"), ("bias_up", "i32"), ("alpha", "fp32"),
                            ("limit", "fp32"),
                            ("num_rows", "i32"), ("top_k", "i32"), ("N", "i32"), ("K", "i32"),
                            ("stride_am", "i32"), ("stride_we", "i64"), ("stride_wn", "i32"), ("stride_om", "i32")],
                           {"GATED": gated, "WEIGHTED": not gated, "BIASED": gpt_oss, "CLAMPED": gpt_oss and gated,
                            "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PRECISION": precision, "F32_DOT": False})
            if "fma.rn.bf16" in ptx:
                print("fused_moe: the compiler fused bfloat16 products into FMAs (rounds unlike eager torch)")
                return 1
    print("fused_moe ok")
    rotary_args = [
        ("q_ptr", _p(bf)), ("k_ptr", _p(bf)), ("v_ptr", _p(bf)), ("pos_ptr", _p("i64")),
        ("cache_ptr", _p("fp32")), ("k_cache_ptr", _p(bf)), ("v_cache_ptr", _p(bf)),
        ("slot_ptr", _p("i64")), ("q_out_ptr", _p(bf)), ("qw_ptr", _p(bf)), ("kw_ptr", _p(bf)),
        ("stride_qt", "i32"), ("stride_qh", "i32"), ("stride_kt", "i32"), ("stride_kh", "i32"),
        ("stride_vt", "i32"), ("stride_vh", "i32"), ("stride_cache", "i32"),
        ("HQ", "i32"), ("HK", "i32"), ("D", "i32"), ("eps", "fp32"),
    ]
    fp8_cache = [(n, _p("fp8e4nv")) if n in ("k_cache_ptr", "v_cache_ptr") else (n, t) for n, t in rotary_args]
    for norm, args, fp8_max in ((False, rotary_args, 0.0), (True, rotary_args, 0.0), (True, fp8_cache, 448.0)):
        ptx = _compile(triton_rotary._rotary_store_kernel, args,
                       {"HAS_NORM": norm, "HALF": 64, "HALF_BLOCK": 64, "HQ_BLOCK": 32, "HK_BLOCK": 8,
                        "FP8_MAX": fp8_max, "PDL": 1})
        if "fma.rn.bf16" in ptx:
            print("rotary: the compiler fused bfloat16 products into FMAs (rounds unlike eager torch)")
            return 1
    print("rotary_and_store ok")
    # The store into llama.cpp's blocks (q8_0 into int8, q4_0 into uint8), launched with
    # enable_fp_fusion=False: no product and sum contracted (its codes are the torch store's).
    for fmt, buf, block_bytes in ((1, "i8", 34), (2, "u8", 18)):
        signature = {"X": _p(bf), "Slots": _p("i64"), "Buf": _p(buf), "stride_xt": "i32", "stride_xh": "i32",
                     "stride_bs": "i32", "stride_bh": "i32", "HK": "i32"}
        consts = {"HK_BLOCK": 8, "NB": 4, "NB_BLOCK": 4, "BLOCK_BYTES": block_bytes, "FMT": fmt}
        ptx = triton.compile(ASTSource(fn=triton_kv_store._store_blocks_kernel,
                                       signature=signature | {name: "constexpr" for name in consts},
                                       constexprs=consts), target=TARGET,
                             options={"enable_fp_fusion": False}).asm["ptx"]
        if "fma.rn.f32" in ptx:
            print("kv block store: a product and a sum were fused into an FMA (rounds unlike the torch store)")
            return 1
    print("kv block store ok")
    V, C = 151936, 38
    f32 = _p("fp32")
    _compile(triton_sampling._penalize_kernel,
             [("logits_ptr", f32), ("counts_ptr", _p("i32")), ("prompt_ptr", _p("u8")), ("fparams_ptr", f32),
              ("out_ptr", f32), ("part_max_ptr", f32)],
             {"V": V, "C": C, "NF": 6, "HAS_PENALTY": True, "HAS_PROMPT": True, "BLOCK": 4096})
    _compile(triton_sampling._scale_kernel,
             [("x_ptr", f32), ("part_max_ptr", f32), ("fparams_ptr", f32), ("row_max_ptr", f32)],
             {"V": V, "C": C, "C_BLOCK": 64, "NF": 6, "BLOCK": 4096})
    for write in (False, True):
        _compile(triton_sampling._draw_chunk_kernel,
                 [("x_ptr", f32), ("fparams_ptr", f32), ("iparams_ptr", _p("i64")), ("part_score_ptr", f32),
                  ("part_idx_ptr", _p("i64")), ("filtered_ptr", f32)],
                 {"V": V, "C": C, "NF": 6, "NI": 3, "WRITE_FILTERED": write, "BLOCK": 4096})
    _compile(triton_sampling._draw_final_kernel,
             [("part_score_ptr", f32), ("part_idx_ptr", _p("i64")), ("row_max_ptr", f32), ("out_ptr", _p("i64"))],
             {"C": C, "C_BLOCK": 64, "INVALID": -1})
    print("sampling ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
