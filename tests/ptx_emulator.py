"""A PTX emulator for the few 32-bit instructions the packed GEMM's decode strings use
(``kernels/quant/triton_packed_gemm.py``), so the CPU tests check what only a GPU runs:
integer ``and``/``or``/``xor``/shifts, ``prmt`` (PTX ISA: byte ``i`` of the result is
byte ``c[4i+2:4i]`` of ``{b, a}``; the sign-replicate bit and the mode suffixes are
refused), ``mov`` (with a ``{lo, hi}`` unpack), bfloat16x2 ``sub``/``fma`` and float16x2
``sub``/``mul`` rounded to nearest even (computed in float64, then rounded through
float32: exact for the tests' operands, whose results float32 holds), float32 ``mul``,
and the conversions ``cvt.f32.f16`` and ``cvt.rn.bf16x2.f32`` (``a`` to the upper half,
``b`` the lower). Any other instruction raises."""

from __future__ import annotations

import re

import numpy as np


def f16_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float16).view(np.uint16))


def f16_value(bits: int) -> float:
    return float(np.array(bits, dtype=np.uint16).view(np.float16))


def bf16_bits(x: float) -> int:
    """float32 of ``x`` rounded to bfloat16, nearest even (finite values)."""
    u = int(np.array(x, dtype=np.float32).view(np.uint32))
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16


def bf16_value(bits: int) -> float:
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _halves(op: str, values: list[int], fmt: str) -> int:
    get, put = (bf16_value, bf16_bits) if fmt == "bf16" else (f16_value, f16_bits)
    out = 0
    for half in (0, 1):
        h = [get((v >> (16 * half)) & 0xFFFF) for v in values]
        # fma rounds once: the product and sum exact in float64 for these operands
        r = h[0] - h[1] if op == "sub" else h[0] * h[1] if op == "mul" else h[0] * h[1] + h[2]
        out |= put(r) << (16 * half)
    return out


def run(asm: str, inputs: dict[int, int]) -> tuple[int, ...]:
    """Run ``asm`` (one ``{ ... }`` block of ``tl.inline_asm_elementwise``) with the
    operands ``$i`` of ``inputs`` (32-bit values); returns ``($0, $1)``."""
    regs: dict[str, float | int] = {f"${i}": v for i, v in inputs.items()}

    def val(token: str):
        token = token.strip()
        if token.startswith("0x"):
            return int(token, 16)
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        return regs[token]

    for stmt in (s.strip() for s in asm.strip()[1:-1].split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            lo, hi, src = re.match(r"\{(\S+), (\S+)\}, (\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        dest, *srcs = (a.strip() for a in rest.split(","))
        v = [val(s) for s in srcs]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            if v[2] & 0x8888:
                raise ValueError("the emulator takes prmt's byte selection only (no sign-replicate bit)")
            src = [(v[0] >> (8 * i)) & 0xFF for i in range(4)] + [(v[1] >> (8 * i)) & 0xFF for i in range(4)]
            r = sum(src[(v[2] >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op in ("sub.rn.bf16x2", "fma.rn.bf16x2"):
            r = _halves(op.split(".")[0], v, "bf16")
        elif op in ("sub.rn.f16x2", "mul.rn.f16x2"):
            r = _halves(op.split(".")[0], v, "f16")
        elif op == "mul.rn.f32":
            r = float(np.float32(v[0]) * np.float32(v[1]))
        elif op == "cvt.f32.f16":
            r = f16_value(v[0])
        elif op == "cvt.rn.bf16x2.f32":
            r = (bf16_bits(v[0]) << 16) | bf16_bits(v[1])
        else:
            raise ValueError(f"the emulator has no {op}")
        regs[dest] = r
    return regs["$0"], regs["$1"]
