"""The packed GEMM's PTX decode strings (``kernels/quant/triton_packed_gemm.py``), which
Triton's interpreter cannot run, through a PTX emulator (:mod:`ptx_emulator`) on random
registers of codes: each gives four weights equal to the code times the bfloat16 scale
plus the bfloat16 offset, rounded once to bfloat16 (Q8_0: the code times the float16
scale rounded to float16, then to bfloat16), in the byte order of their register."""

from __future__ import annotations

import numpy as np
import pytest
from ptx_emulator import bf16_bits, bf16_value, f16_bits, f16_value, run

from kernels.quant import triton_packed_gemm as packed

# A scale and an offset of their own for each of the four weights of a register (the
# pack's registers hold them in pairs), so a swapped half or register shows.
SCALES, OFFSETS = (0.031, 0.0517, 0.0022, 1.75), (-0.2, 0.61, -0.0093, 3.5)


def _pair(lo: float, hi: float) -> int:
    return bf16_bits(lo) | (bf16_bits(hi) << 16)


def _weights(out: tuple[int, int]) -> list[float]:
    return [bf16_value((r >> (16 * h)) & 0xFFFF) for r in out for h in (0, 1)]


def _want(codes: list[int]) -> list[float]:
    return [bf16_value(bf16_bits(c * bf16_value(bf16_bits(s)) + bf16_value(bf16_bits(o))))
            for c, s, o in zip(codes, SCALES, OFFSETS, strict=True)]


def _bytes(word: int, shift: int = 0, mask: int = 0xFF) -> list[int]:
    return [((word >> (8 * i)) >> shift) & mask for i in range(4)]


ST = {3: _pair(*SCALES[:2]), 4: _pair(*SCALES[2:]), 5: _pair(*OFFSETS[:2]), 6: _pair(*OFFSETS[2:])}
WORDS = [int(w) for w in np.random.default_rng(0).integers(0, 2**32, 300)] + [0, 0xFFFFFFFF, 0x80808080, 0x0F1E2D3C]


@pytest.mark.parametrize("high", [0, 1])
def test_nibbles(high):
    asm = packed._Q4.value[high]
    for w in WORDS:
        assert _weights(run(asm, {2: w, **ST})) == _want(_bytes(w, 4 * high, 15)), hex(w)


@pytest.mark.parametrize("sub", range(8))
def test_q5_k_codes(sub):
    asm = packed._Q5.value[sub]
    st = {k + 1: v for k, v in ST.items()}  # qh is $3: the scale pairs from $4
    for qs, qh in zip(WORDS, reversed(WORDS), strict=True):
        codes = [lo | (hi << 4) for lo, hi in zip(_bytes(qs, 4 * (sub % 2), 15), _bytes(qh, sub, 1), strict=True)]
        assert _weights(run(asm, {2: qs, 3: qh, **st})) == _want(codes), (hex(qs), hex(qh))


@pytest.mark.parametrize("group", range(4))
def test_q6_k_codes(group):
    asm = packed._Q6.value[group]
    st = {k + 1: v for k, v in ST.items()}
    for ql, qh in zip(WORDS, reversed(WORDS), strict=True):
        codes = [lo | (hi << 4) for lo, hi in zip(_bytes(ql, 4 * (group // 2), 15), _bytes(qh, 2 * group, 3),
                                                  strict=True)]
        assert _weights(run(asm, {2: ql, 3: qh, **st})) == _want(codes), (hex(ql), hex(qh))


@pytest.mark.parametrize("scale", [0.0123, 3.1e-7, 6.1e-5, 900.0, 65504.0])
def test_q8_0_codes(scale):
    """The code times its own weight's float16 scale rounded once to bfloat16, whatever
    the scale (a float16 subnormal, or one whose product float16 could not hold). The
    four weights of a register take four different scales: a pack's elements can come
    from different weight rows, each with its block's scale."""
    ds = [f16_bits(scale * f) for f in (1.0, 0.5, 0.75, 0.25)]
    for w in WORDS:
        codes = [b - 256 if b > 127 else b for b in _bytes(w)]
        want = [bf16_value(bf16_bits(c * f16_value(d))) for c, d in zip(codes, ds, strict=True)]
        regs = {2: w, 3: ds[0] | (ds[1] << 16), 4: ds[2] | (ds[3] << 16)}
        assert _weights(run(packed._Q8.value, regs)) == want, hex(w)
