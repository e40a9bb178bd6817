"""Rounding float32 values to a narrower float type inside Triton kernels.

The fused kernels reproduce eager torch's rounding after each operation (each bf16 op
rounds its float32 result to nearest-even). A plain ``x.to(bf16).to(fp32)`` round trip
does not say that reliably: Triton 3.6 lowers ``round(round(a*b) - round(c*d))`` written
that way to bfloat16 FMA instructions (``fma.rn.bf16`` in the PTX: one rounding where
eager torch has three), and the rotary kernel written so matched the eager ops bit for
bit in only 78% of elements on an H200; Triton's interpreter truncates instead of
rounding. Integer arithmetic on the bits is kept as written by both, so bfloat16 is
rounded here that way: add half an ulp (ties to even) and clear the low 16 bits.
``tests/triton_compile_check.py`` checks the PTX for bfloat16 FMAs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dt: tl.constexpr):
    """``x`` (float32) rounded to the nearest value of ``dt``, kept in float32. NaN
    stays NaN; overflow becomes inf, as a cast would."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
