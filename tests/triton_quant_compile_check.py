"""Compile the GGUF dequantize-GEMV and GEMM kernels for a Hopper GPU (sm_90) without
one, the decode and prefill variants, and report register spills: every block type, or
the types named as arguments (``python tests/triton_quant_compile_check.py Q4_K Q4_1``).

Run as a script in its own process (Triton's mode is fixed at import, and the test
session imports it in interpreter mode): the interpreter accepts code the compiler
refuses. Prints one line per kernel variant; exits non-zero on a failure or a spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.quant import (  # noqa: E402
    triton_activations,
    triton_dequant,
    triton_int8,
    triton_int8_gemm,
    triton_packed_gemm,
)
from kernels.quant import triton_kernel as triton_quant  # noqa: E402
from kernels.quant.formats import FORMATS, REPACKED, block_format  # noqa: E402
from kernels.quant.gemm_tuning import (  # noqa: E402
    DEFAULT_TILING,
    GEMM_TILINGS,
    IEEE_TILING,
    INT8_TILINGS,
    PACKED_TILINGS,
)
from kernels.quant.triton_decode import gemm_subs, layout_constexprs  # noqa: E402
from kernels.quant.triton_int8_gemm import INT8_GEMM_TYPES  # noqa: E402

# Every GGUF type kept quantized and every layout the loader repacks into.
LAYOUTS = {**FORMATS, **REPACKED}

TARGET = GPUTarget("cuda", 90, 32)


def _compile(fn, args: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 3) -> tuple[int, int, str]:
    """``(registers, stack frame bytes, ptx)`` of one variant, from the ptxas Triton
    uses for sm_90, run with ``-v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    signature = args | {name: "constexpr" for name in constexprs}
    # As a launch specializes them: pointers and the row and activation strides 16-byte
    # aligned (what lets the byte reads vectorize).
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in args
               if args[a].startswith("*") or a in ("row_bytes", "row_words", "row_halves", "stride_xm", "stride_xq", "K",
                                                   "row_bytes1", "row_words1", "row_halves1")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    ptx = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", err).group(1))
    frame = int(re.search(r"(\d+) bytes stack frame", err).group(1))
    return regs, frame, ptx


def _loads(ptx: str) -> str:
    """The global load widths in the PTX, e.g. ``u8 x40, v2.b32 x8``: how the byte
    reads were vectorized."""
    found = re.findall(r"ld\.global(?:\.[a-z]+)*?\.((?:v\d\.)?[a-z]\d+)", ptx)
    counts: dict[str, int] = {}
    for kind in found:
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


def _int8_variants(type_names: list[str]) -> int:
    """The int8-activation GEMV (:mod:`kernels.quant.triton_int8`) of ``type_names`` at a
    few tilings, on quantized codes and quantizing bfloat16 rows itself (``QUANT_X``),
    with Q4_K the kernel of a Q4_K part over a Q6_K_P part, and the activation quantizer;
    returns how many spill (``QUANT_X``'s spills are printed only: an opt-in mode), or
    (``QUANT_X``) multiply more weight words than the kernel on codes or round each
    activation on more than one thread (the compiler's layouts decide both)."""
    failures = 0
    args = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*i32", "w32_ptr": "*i32", "w16_ptr": "*i16",
            "w8_ptr": "*u8", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "row_bytes": "i32",
            "row_words": "i32", "row_halves": "i32", "blocks_per_split": "i32", "stride_xq": "i32",
            "stride_xd": "i32", "stride_xs": "i32", "stride_om": "i32", "w32b_ptr": "*i32", "w16b_ptr": "*i16",
            "w8b_ptr": "*u8", "N1": "i32", "row_bytes1": "i32", "row_words1": "i32", "row_halves1": "i32"}
    # QUANT_X: the float row in place of the codes (the scale and sum pointers unused).
    args_x = args | {"xq_ptr": "*bf16", "xd_ptr": "*bf16", "xs_ptr": "*bf16"}
    for name in type_names:
        for block_n, kb, warps, split, prefetch in ((4, 4, 2, 0, 0), (32, 4, 8, 0, 0), (32, 4, 8, 0, 1),
                                                     (16, 4, 4, 1, 0), (16, 4, 4, 1, 1), (2, 16, 2, 0, 0)):
            if split and name != "Q4_K":
                continue
            products = None
            for quant_x in (0, 1):
                regs, frame, ptx = _compile(triton_int8._int8_gemv_kernel, args_x if quant_x else args, {
                    "QT": block_format(name).code, "BLOCK_N": block_n, "KB": kb, "PARTIALS": False, "ASM": True,
                    "ABL": 0, "SPLIT": split, "PREFETCH": prefetch, "QUANT_X": quant_x, "QT1": 0, "PDL": 1}, warps)
                # A line per dp4a on codes; with QUANT_X each line also counts the codes' sum.
                lines = len(re.findall(r"^\s*dp4a.*$", ptx, re.M))
                floors = ptx.count("cvt.rmi")  # two per activation rounded (_q8_round)
                print(f"gemv int8 {name} {block_n}x{kb}{' split' if split else ''}{' prefetch' if prefetch else ''}"
                      f"{' x-quant' if quant_x else ''}: {regs} registers, {frame} B stack; dp4a x{lines}"
                      f"{f', floors x{floors}' if quant_x else ''}; loads {_loads(ptx)}")
                # QUANT_X is an opt-in comparison mode (slower on the H200): its spills are
                # reported, not failed (Q6_K in GGUF blocks at 32x4 spilled 8 bytes on sm_90).
                failures += frame > 0 and not quant_x
                if quant_x:
                    once = 2 * kb * 256 // (32 * warps)
                    if lines != products or floors > once:
                        print(f"  x-quant: {lines} dp4a lines against {products} on codes, {floors} floors "
                              f"against {once} (each activation once)")
                        failures += 1
                products = lines
    if "Q4_K" in type_names:  # two parts in one launch: a Q4_K_M file's q/k over its v
        for block_n, kb, warps, prefetch in ((8, 2, 4, 0), (32, 4, 8, 1)):
            for quant_x in (0, 1):
                regs, frame, _ = _compile(triton_int8._int8_gemv_kernel, args_x if quant_x else args, {
                    "QT": 5, "BLOCK_N": block_n, "KB": kb, "PARTIALS": False, "ASM": True, "ABL": 0, "SPLIT": 0,
                    "PREFETCH": prefetch, "QUANT_X": quant_x, "QT1": 8, "PDL": 1}, warps)
                print(f"gemv int8 Q4_K over Q6_K_P {block_n}x{kb}{' prefetch' if prefetch else ''}"
                      f"{' x-quant' if quant_x else ''}: {regs} registers, {frame} B stack")
                failures += frame > 0 and not quant_x
    if type_names:
        regs, frame, _ = _compile(triton_activations._quantize_kernel, {
            "x_ptr": "*bf16", "q_ptr": "*i8", "d_ptr": "*fp32", "s_ptr": "*i32", "groups": "i32",
            "stride_xm": "i32", "stride_qm": "i32", "stride_dm": "i32", "stride_sm": "i32"}, {"G": 32, "PDL": 1}, 4)
        print(f"quantize int8: {regs} registers, {frame} B stack")
        failures += frame > 0
    return failures


def main(type_names: list[str]) -> int:
    unknown = [name for name in type_names if name not in LAYOUTS]
    if unknown:
        print(f"not kept quantized: {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
        return 2
    failures = 0
    common = {"M": "i32", "N": "i32", "K": "i32", "row_bytes": "i32"}
    for fmt in (LAYOUTS[name] for name in type_names or LAYOUTS):
        layout = layout_constexprs(fmt)
        for atomic, block_n, kb, warps in ((False, 4, 2, 4), (False, 1, 4, 2), (True, 4, 2, 4)):
            kb = kb if fmt.block_elements > 32 else kb * 8
            out = "*fp32" if atomic else "*bf16"
            args = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": out, **common, "blocks_per_split": "i32",
                    "stride_xm": "i32", "stride_om": "i32"}
            regs, frame, ptx = _compile(triton_quant._gemv_kernel, args, {
                **layout, "BLOCK_N": block_n, "KB": kb, "PARTIALS": atomic, "ASM": True,
            }, warps)
            print(f"gemv {fmt.name} {block_n}x{kb}{' partials' if atomic else ''}: {regs} registers, {frame} B stack; "
                  f"loads {_loads(ptx)}")
            failures += frame > 0
        # Every tiling the tuner may pick, at the rows per tile it may pick it for; float32
        # rows (IEEE) and split-K (float32 partials) at the untimed default.
        variants = [("bf16", False, False, block_m, tiling) for block_m in (16, 32, 64) for tiling in GEMM_TILINGS]
        variants += [("fp32", True, False, 64, IEEE_TILING), ("bf16", False, True, 16, DEFAULT_TILING)]
        for dtype, ieee, atomic, block_m, tiling in variants:
            out = "*fp32" if atomic else f"*{dtype}"
            args = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "out_ptr": out, **common, "blocks_per_split": "i32",
                    "stride_xm": "i32", "stride_om": "i32"}
            regs, frame, _ = _compile(triton_quant._gemm_kernel, args,
                                      {**layout, "BLOCK_M": block_m, "BLOCK_N": tiling.block_n, "IEEE": ieee,
                                       "PARTIALS": atomic, "SUBS": gemm_subs(fmt, tiling.k_step)},
                                      tiling.num_warps, tiling.num_stages)
            print(f"gemm {fmt.name} {dtype} {block_m}x{tiling.block_n} k{tiling.k_step} w{tiling.num_warps} "
                  f"s{tiling.num_stages}{' partials' if atomic else ''}: {regs} registers, {frame} B stack")
            failures += frame > 0
        if fmt.name in INT8_GEMM_TYPES:  # the int8 tensor-core GEMM at each of its tilings
            for block_m, tiling in ((b, t) for b in (16, 32, 64) for t in INT8_TILINGS):
                args = {"xq_ptr": "*i8", "xd_ptr": "*fp32", "xs_ptr": "*i32", "w_ptr": "*u8", "out_ptr": "*bf16",
                        **common, "blocks_per_split": "i32", "stride_xq": "i32", "stride_xd": "i32",
                        "stride_xs": "i32", "stride_om": "i32"}
                regs, frame, ptx = _compile(triton_int8_gemm._int8_gemm_kernel, args,
                                            {**layout, "BLOCK_M": block_m, "BLOCK_N": tiling.block_n,
                                             "GROUPS": tiling.k_step // 32, "PARTIALS": False},
                                            tiling.num_warps, tiling.num_stages)
                mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "no mma"
                print(f"gemm int8 {fmt.name} {block_m}x{tiling.block_n} k{tiling.k_step} w{tiling.num_warps} "
                      f"s{tiling.num_stages}: {regs} registers, {frame} B stack; {mma}")
                failures += frame > 0 or mma == "no mma"
        if fmt.name in triton_packed_gemm.PACKED_TYPES:  # the packed GEMM at each tiling and rows a tile
            for block_m, tiling in ((b, t) for b in (16, 32, 64) for t in PACKED_TILINGS):
                args = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", **common, "blocks_per_split": "i32",
                        "stride_xm": "i32", "stride_om": "i32"}
                regs, frame, ptx = _compile(triton_packed_gemm._packed_gemm_kernel, args,
                                            {"QT": triton_packed_gemm.PACKED_TYPES[fmt.name], "BLOCK_M": block_m,
                                             "BLOCK_N": tiling.block_n, "PARTIALS": False, "ASM": True},
                                            tiling.num_warps, tiling.num_stages)
                decodes = ptx.count("fma.rn.bf16x2") + ptx.count("cvt.rn.bf16x2.f32")
                print(f"gemm packed {fmt.name} {block_m}x{tiling.block_n} w{tiling.num_warps} s{tiling.num_stages}: "
                      f"{regs} registers, {frame} B stack; bf16x2 decodes x{decodes}")
                failures += frame > 0 or decodes == 0
        args = {"w_ptr": "*u8", "out_ptr": "*bf16", "N": "i32", "row_bytes": "i32", "nblocks": "i32", "stride_on": "i32"}
        regs, frame, _ = _compile(triton_dequant._dequantize_kernel, args, {**layout, "BLOCK_N": 32}, 4)
        print(f"dequantize {fmt.name}: {regs} registers, {frame} B stack")
        failures += frame > 0
    failures += _int8_variants([name for name in type_names or LAYOUTS if name in triton_int8.INT8_TYPES])
    print("quant kernels ok" if not failures else f"{failures} variants spill registers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
