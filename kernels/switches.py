"""The kernel switches: which kernel runs where more than one could, declared once.

:class:`KernelSwitches` lists every switch with its default and its help (plain field
metadata, so :mod:`kernels` stays free of the engine). The engine's option system
derives a real option from each field (:class:`engine.common.config.EngineConfig`): the
flag ``--NAME``/``--no-NAME`` (dashes), the environment variable ``HEADROOM_NAME``
(capitals) and the config file key ``NAME``, e.g. ``quant_int8``: ``--no-quant-int8``,
``HEADROOM_QUANT_INT8=0``, ``quant_int8 = false``. The engine hands the resolved values
to :func:`configure` when it starts; the kernels read :func:`current` when they are
called or launched, never at import, so a benchmark or a test can switch between
captures (:func:`using`). Nothing here reads the environment.

One process holds one set of switches: two engines in one process share them (the last
one started sets them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def _switch(default: Any, help: str, choices: tuple[str, ...] = (), minimum: int | None = None) -> Any:
    """A field of :class:`KernelSwitches`: its default, its ``--help`` text, for a text
    switch the values it takes, for a count its least value."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum})


@dataclass(frozen=True)
class KernelSwitches:
    """Every kernel choice (module docstring). Bool switches are on/off; ``kernels`` is
    ``auto`` or ``torch``; the ``*_rows`` switches are row counts."""

    kernels: str = _switch(
        "auto",
        "Kernels: auto (Triton on CUDA tensors, the torch references elsewhere) or torch "
        "(the torch references everywhere, to bisect a numerical difference on the GPU).",
        choices=("auto", "torch"),
    )
    pdl: bool = _switch(
        True,
        "Launch the decode step's Triton kernels with programmatic dependent launch "
        "(Hopper and later: a kernel starts while the one before it drains; "
        "kernels.pdl). Off: stream order, to time the difference.",
    )
    gemv: bool = _switch(
        False,
        "Decode projections of a few rows on headroom's Triton GEMV instead of cuBLAS "
        "(no faster on an H200; kernels.gemv).",
    )
    cpu_kernels: bool = _switch(
        True,
        "On the CPU, GGUF blocks and decode layers on headroom's C kernels (built at first "
        "use; kernels.cpu). Off: torch's kernels, to compare or where a build misbehaves.",
    )
    cpu_block_gemm: bool = _switch(
        True,
        "On a CPU with AVX-512, GGUF Q4_0/Q4_1/Q8_0 products of any number of rows on the "
        "C block GEMM (kernels/cpu/block_gemm.c), prefill included, and Q4_K/Q5_K/Q6_K ones "
        "(CPU experts too) on its K-quant tile (kernels/cpu/kquant_gemm.c). Off: the AVX2 "
        "tile, from 64 rows the weights dequantized to float32 for torch's GEMM (as on a CPU "
        "without AVX-512), and the K-quants' AVX2 row product, to compare.",
    )
    cpu_kquant_act_bits: str = _switch(
        "16",
        "On the CPU, the bits of the activation codes Q4_K/Q5_K/Q6_K row products take (linear "
        "layers, CPU experts, prefill on the K-quant tile): 16 (int16 codes per block of 32, "
        "kernels/cpu/kquant.c) or 8 (int8 codes, byte products, kernels/cpu/kquant8.c: faster, "
        "and a product's error bound is 258 times the 16-bit codes' or more; docs/cpu.md).",
        choices=("8", "16"),
    )
    cpu_rows16: bool = _switch(
        True,
        "On a CPU with AVX-512, a CPU model's layer projections and LM head of Q4_0/Q4_1/Q8_0 "
        "blocks, and of Q4_K/Q5_K/Q6_K while cpu_kquant_act_bits is 16, interleaved by 16 weight "
        "rows at load (kernels/cpu/rows16.c: a register's lanes are 16 rows, a block's scales "
        "one load), the same bytes and products, the layers in one buffer of huge pages in the "
        "order a decode step reads them. Off: the GGUF layout on the block GEMM, to compare.",
    )
    quant_repack: bool = _switch(
        True,
        "On CUDA, repack Q6_K blocks into aligned planes at load (kernels.quant.repack). "
        "Off: GGUF's layout, to time it.",
    )
    quant_ptx: bool = _switch(
        True,
        "GGUF block GEMVs convert codes with inline PTX (kernels.quant). Off: Triton's "
        "own conversions, to compare.",
    )
    quant_gemv_rows: int = _switch(
        8,
        "GGUF block projections: activation rows up to which the GEMV runs (each row reads "
        "the weights, from L2 after the first); above, the tile GEMM, which reads them once "
        "(kernels.quant). On an H200, an 8B Q4_K_M-layout decode step took 29.5 ms at 16 rows "
        "on the GEMV and 18.3 ms at 64 on the GEMM.",
        minimum=0,
    )
    quant_dequant_rows: int = _switch(
        256,
        "GGUF block projections: activation rows (a prefill chunk) from which the weight is "
        "dequantized whole into the activations' dtype and multiplied by cuBLAS, its "
        "scratch freed after; 0: never (kernels.quant.triton_dequant).",
        minimum=0,
    )
    quant_int8: bool = _switch(
        True,
        "Q4_K/Q6_K decode rows on the int8-activation GEMV (kernels.quant.triton_int8). "
        "Off: the float GEMV.",
    )
    quant_gemm_packed: bool = _switch(
        True,
        "GGUF Q4_0, Q8_0, Q4_K, Q5_K and Q6_K (repacked into planes) blocks between the "
        "GEMV's rows and the dequantize rows, bfloat16 activations on CUDA: the packed GEMM, which decodes four codes a register into "
        "bfloat16 pairs with the scale applied in PTX (kernels.quant.triton_packed_gemm), "
        "instead of the float tile GEMM. Off: the tile GEMM, to compare.",
    )
    quant_gemm_int8: bool = _switch(
        False,
        "GGUF block projections between the GEMV's rows and the dequantize rows: the int8 "
        "tensor-core GEMM (activations rounded to int8 per 32, as the int8 GEMV does; "
        "kernels.quant.triton_int8_gemm) instead of the float tile GEMM. Each times its "
        "own tilings per shape.",
    )
    expert_bus_reads: bool = _switch(
        True,
        "Decode steps of mixture-of-experts layers whose experts live in host memory: "
        "the fused kernel reads each missing expert from pinned host memory over the bus "
        "and the cached ones from the device, with no copy and no host round trip "
        "(engine.layers.moe.bus_reads). Off: each step copies the missing experts into "
        "the cache or runs them on the CPU, as prefill does.",
    )
    expert_staged_prefill: bool = _switch(
        True,
        "Prefill chunks of mixture-of-experts layers whose experts live in host memory, "
        "read over the bus, of 32 routed rows an expert or more: the missing experts are "
        "copied through a transient stage on the device in waves (each read over the bus "
        "once) instead of the prefill GEMM reading them once per block of 64 rows "
        "(engine.layers.moe.staged_prefill). Off: every chunk reads over the bus.",
    )
    expert_cpu_share: str = _switch(
        "off",
        "Decode steps of mixture-of-experts layers whose experts live in host memory, read "
        "over the bus: auto splits each such layer's uncached experts between the bus and "
        "the CPU's cores by their measured rates, so both halves take about as long (the "
        "CPU's run by the C kernels as a host function inside the decode CUDA graphs; "
        "engine.layers.moe.cpu_share). Off (the default: on an H200 host it made decode "
        "22-24% slower, docs/moe.md): every missing expert over the bus.",
        choices=("auto", "off"),
    )
    quant_int8_fuse: bool = _switch(
        False,
        "The int8 GEMV quantizes its float activations itself as it reads them, instead "
        "of a launch of their own first (one launch less, slower on an H200).",
    )
    quant_int8_parts: bool = _switch(
        True,
        "A projection of a Q4_K and a Q6_K part (q/k/v of a Q4_K_M file) is one int8 "
        "GEMV launch. Off: a launch a part.",
    )
    quant_int8_producer: bool = _switch(
        True,
        "Activations for the int8 GEMV are quantized by the RMSNorm or SiLU-and-mul "
        "kernel that writes them, where there is one. Off: by a launch of their own.",
    )


_current = KernelSwitches()


def configure(switches: KernelSwitches) -> None:
    """Make ``switches`` the ones every kernel reads from now on (the engine calls this
    at start, with the values of its options)."""
    global _current
    if not isinstance(switches, KernelSwitches):
        raise TypeError(f"want KernelSwitches, got {type(switches).__name__}")
    _current = switches


def current() -> KernelSwitches:
    """The switches in force (the defaults until :func:`configure`)."""
    return _current


@contextlib.contextmanager
def using(**changes: Any) -> Iterator[KernelSwitches]:
    """The switches in force with ``changes`` (field names) while the block runs, then
    as they were: for benchmarks that time the variants and tests that flip a switch.

    Raises:
        TypeError: a name that is not a switch.
    """
    before = _current
    configure(dataclasses.replace(before, **changes))
    try:
        yield _current
    finally:
        configure(before)
