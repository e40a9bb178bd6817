"""Decode GEMV over Q4_K/Q6_K blocks with int8 activations and integer dot products.

The float GEMV (:func:`kernels.quant.triton_kernel.quant_gemv`) turns every weight into
a float32 and multiplies it: about 6.7 instructions a Q4_K weight, so it is bound by
instruction issue, not by HBM. Here, as llama.cpp's MMVQ kernels do, the activation
row is quantized (int8 codes, one float32 scale per 32 values, ``scale = amax / 127``,
codes rounded half away from zero, and the codes' sum per 16 values), and each 32-bit
word of weight codes is multiplied by a word of activation codes with one ``dp4a``
(four int8 products summed into an int32; PTX ``dp4a.s32.s32``, emulated with shifts in
Triton's interpreter):

- Q4_K: a word of ``qs`` holds 4 codes of sub-block ``2r`` (low nibbles) and 4 of
  ``2r + 1`` (high nibbles); two masks and a shift make two int8 words, two ``dp4a``
  take 8 weights. Per sub-block (32 weights) and row:
  ``d * sc * dot * dx - dmin * mn * dx * sum(codes)``.
- Q6_K: a word of ``ql``'s first 32 bytes of a half, the word 32 bytes on and the word
  of ``qh`` at the same place hold 16 codes of four sub-blocks (ggml's
  ``dequantize_row_q6_K`` order); masks and shifts put the two high bits under each
  nibble. The codes are ``0..63`` with zero point 32, taken off through the
  activations' sum: ``d * sc * (dot - 32 * sum(codes)) * dx`` per sub-block of 16.
  Blocks are 210 bytes, so their words are read as two 16-bit halves.

Counting the source's operations, the dot products take 0.6 instructions a Q4_K
weight (the float GEMV about 6.7), about two a Q6_K weight. The activations are rounded
to int8 (llama.cpp does the same; the error is at most half a code step, ``amax / 254``
of each group of 32), so results differ from the float GEMV by that rounding;
:func:`kernels.quant.reference.quant_matmul_int8` is the exact reference of this
arithmetic. Block layouts as ggml-common.h's ``block_q4_K``/``block_q6_K``; the scheme
as llama.cpp's ``quantize_q8_1`` and ``vec_dot_q4_K_q8_1``/``vec_dot_q6_K_q8_1``.

Where the rows are quantized (:mod:`kernels.quant.triton_activations`): llama.cpp
quantizes them in a launch of their own (``quantize_activations``), and so does
:func:`int8_gemv` by default (given its codes), unless the kernel that wrote the rows
quantized them as it did (the decoder's norms and SiLU-and-mul, ``quantize=True``,
through ``q8_groups``, the same code). Given the float rows it quantizes them itself
(``QUANT_X``; one launch less per projection, each 2-4 us in a CUDA graph, but measured
slower, so off by default: the ``quant_int8_fuse`` switch of :mod:`kernels.switches`):
each program, at each step, loads the float activations of its ``KB`` blocks once,
quantizes every group of 32 with the quantizing launch's own arithmetic (``q8_inv``,
``q8_round``, ``q8_scale``: the same codes and
scales bit for bit, so the same results at the same tiling) in a tile of its own whose
activations are spread over the program's threads (each rounded once), and the codes
go to the weight tile's layout through shared memory for all ``BLOCK_N`` rows; the
codes' sums are counted with the products (a second ``dp4a`` with ``0x01010101``).
Every program so quantizes its own slice of the row (the quantizing launch did it once
for all of them), work that more rows a program share: hence tilings tried only in
this mode (:data:`_QUANT_X_TILINGS`).

A fused projection whose parts differ in type (a Q4_K_M file's q and k in Q4_K over v in
Q6_K) is one launch too (:func:`int8_gemv_parts`): the first part's weight tiles, then
the second's, each program of one part (a branch on its tile, both types compiled in),
so each part's columns are what its own launch gives at the same tiling.

Tiling: one program per (activation row, ``BLOCK_N`` weight rows, range of K), ``KB``
blocks per step in a ``[BLOCK_N, KB, 4, words]`` tile whose rows come first, so a thread
holds the same words of several rows and loads the activation words once for them
(``SPLIT``, Q4_K: each run of 8 words as two 4-word tiles, so one thread holds a whole
run); Q4_K's 16-byte header is read as four words. Autotuned per (N, K, type, mode,
second part); split-K below two rows per SM, as the float GEMV. Triton gives a step's
values the layout of whichever tile's loads it propagates first, the last issued: a
step reads its activations before its weight words so that the weight tile's layout
wins (the activations are moved, not the weights; the accumulator, hence the order of
the final sums, the same in both modes).

Q6_K rows are read from their repacked planes (``Q6_K_P``, :mod:`kernels.quant.repack`)
as whole, aligned words; each step can load the next step's words before its own
arithmetic (``PREFETCH``, a tuned choice). The step itself (the words, the dot
products, the K loop) is :mod:`kernels.quant.triton_int8_dot`. On the H200 this is the
default decode GEMV for Q4_K/Q6_K (docs/gpu.md, "The int8 decode path"; the
``quant_int8`` switch off, ``--no-quant-int8``, turns it off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.quant.formats import block_format
from kernels.quant.int8_choice import INT8_TYPES
from kernels.quant.split_k import partials_at, split_k_ranges, split_output, sum_partials
from kernels.quant.triton_activations import Q8Activations
from kernels.quant.triton_decode import (
    GemvTiling,
    gemv_tiling,
    output_for,
    ptx_enabled,
)
from kernels.quant.triton_int8_dot import rows_dot

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's
    from typing_extensions import Unpack


@triton.jit
def _int8_gemv_kernel(
    xq_ptr, xd_ptr, xs_ptr, w32_ptr, w16_ptr, w8_ptr, out_ptr, M, N, K, row_bytes, row_words, row_halves,
    blocks_per_split, stride_xq, stride_xd, stride_xs, stride_om,
    w32b_ptr, w16b_ptr, w8b_ptr, N1, row_bytes1, row_words1, row_halves1,
    QT: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, PARTIALS: tl.constexpr, ASM: tl.constexpr,
    ABL: tl.constexpr = 0, SPLIT: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, QUANT_X: tl.constexpr = 0,
    QT1: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    # ABL (timing only; wrong results): 1 leaves out the scales (the dot products times
    # the activation scales), 2 also the dot products (the weight words summed), so
    # differences of times place the kernel's time by stage (docs/benchmarks.md).
    # QUANT_X: xq_ptr is the float activation row itself (stride_xq in elements; xd_ptr
    # and xs_ptr unused), quantized step by step in registers once for the BLOCK_N rows
    # (_q4k_act, _q6k_act): no launch and no round trip through memory for the codes.
    # QT1: a second part (type QT1, N1 rows at w32b_ptr/w16b_ptr/w8b_ptr) under the
    # first, written to output columns N ... N + N1 - 1 by the programs after the first
    # part's tiles; 0: one part (the second's arguments unused).
    # PDL: launched before the kernel that wrote the activations ends (kernels.pdl);
    # rows_dot waits for it after loading its first weight words.
    # Grid as the float GEMV's: axis 0 = activation rows x weight tiles (the rows of
    # one tile launched together, so all but the first read it from L2), axis 1 = K ranges.
    pid_m = tl.program_id(0) % M
    pid_n = tl.program_id(0) // M
    pid_k = tl.program_id(1)
    x32 = xq_ptr + pid_m.to(tl.int64) * stride_xq  # int32 words of int8 codes, or (QUANT_X) floats
    xd = xd_ptr + pid_m.to(tl.int64) * stride_xd
    xs = xs_ptr + pid_m.to(tl.int64) * stride_xs
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, K // 256)
    if QT1 == 0:
        total = rows_dot(QT, w32_ptr, w16_ptr, w8_ptr, pid_n * BLOCK_N, N, K, row_bytes, row_words, row_halves, x32,
                          xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT, PREFETCH, QUANT_X, PDL)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        end = N
    else:
        # A tile is one part's rows: the first part's last tile is partial, not shared.
        tiles0 = tl.cdiv(N, BLOCK_N)
        if pid_n < tiles0:
            total = rows_dot(QT, w32_ptr, w16_ptr, w8_ptr, pid_n * BLOCK_N, N, K, row_bytes, row_words, row_halves,
                              x32, xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT, PREFETCH, QUANT_X, PDL)
        else:
            total = rows_dot(QT1, w32b_ptr, w16b_ptr, w8b_ptr, (pid_n - tiles0) * BLOCK_N, N1, K, row_bytes1,
                              row_words1, row_halves1, x32, xd, xs, kb_begin, kb_end, BLOCK_N, KB, ASM, ABL, SPLIT,
                              PREFETCH, QUANT_X, PDL)
        second = pid_n >= tiles0
        cols = tl.where(second, N + (pid_n - tiles0) * BLOCK_N, pid_n * BLOCK_N) + tl.arange(0, BLOCK_N)
        end = tl.where(second, N + N1, N)
    out = partials_at(out_ptr, pid_k, M, stride_om, PARTIALS) + pid_m * stride_om + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=cols < end)


def _configs() -> list[triton.Config]:
    """Tilings the tuned kernel picks from per (N, K, type): weight rows per program,
    blocks of K per step, warps, and for Q4_K whether a thread holds whole runs
    (``SPLIT``; then the tile's ``BLOCK_N * KB * 4`` runs at least fill the threads),
    each with and without the next step's words loaded ahead (``PREFETCH``). The plain
    ones were the best on the H200 for some 8B projection shape."""
    plain = [{"BLOCK_N": block_n, "KB": kb, "num_warps": warps}
             for block_n, kb, warps in ((8, 2, 4), (8, 4, 4), (4, 4, 2), (8, 8, 4), (32, 4, 8))]
    split = [{"BLOCK_N": block_n, "KB": kb, "SPLIT": 1, "num_warps": warps}
             for block_n, kb, warps in ((16, 4, 4), (32, 4, 8), (8, 2, 2))]
    # Few rows, many blocks a step: a small projection (q/k/v, o: one wave of programs,
    # latency-bound) issues all of a row's loads at once, as a 4096-wide row is 16 blocks.
    # With PREFETCH its one step's words are loaded before the loop, so under PDL
    # (kernels.pdl) before the wait for the kernel before it.
    wide = [{"BLOCK_N": block_n, "KB": kb, "num_warps": warps}
            for block_n, kb, warps in ((2, 16, 2), (4, 16, 4), (4, 8, 2), (1, 16, 2)) + _QUANT_X_TILINGS]
    return [triton.Config({k: v for k, v in c.items() if k != "num_warps"} | {"PREFETCH": prefetch},
                          num_warps=c["num_warps"])
            for c in plain + split + wide for prefetch in (0, 1)]


# (BLOCK_N, KB, warps) tried only when the kernel quantizes its rows (QUANT_X): every
# program quantizes the activations of its K range once a step, so more rows a program
# share that work, and a small projection's row is still one step or two.
_QUANT_X_TILINGS = ((8, 16, 4), (16, 8, 4))


def _prune(configs, named_args, **kwargs):
    """``SPLIT`` is Q4_K's alone (a part's); the :data:`_QUANT_X_TILINGS` are ``QUANT_X``'s."""
    quant_x = named_args.get("QUANT_X", kwargs.get("QUANT_X"))
    q4k = 5 in (named_args.get("QT", kwargs.get("QT")), named_args.get("QT1", kwargs.get("QT1")))
    return [c for c in configs if (q4k or not c.kwargs.get("SPLIT"))
            and (quant_x or (c.kwargs["BLOCK_N"], c.kwargs["KB"], c.num_warps) not in _QUANT_X_TILINGS)]


_tuned = triton.autotune(
    configs=_configs(), key=["N", "K", "QT", "QUANT_X", "N1", "QT1"], prune_configs_by={"early_config_prune": _prune},
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles),
)(_int8_gemv_kernel)


def int8_gemv(
    x: torch.Tensor | Q8Activations,
    blocks: torch.Tensor,
    type_name: str,
    *,
    out: torch.Tensor | None = None,
    variant: dict | None = None,
    **tiling: Unpack[GemvTiling],
) -> torch.Tensor:
    """``x @ W.T`` for ``x``'s activations rounded to int8 and ``W`` in Q4_K or Q6_K
    ``blocks`` (or Q6_K repacked as ``Q6_K_P``, :mod:`kernels.quant.repack`).

    Args:
        x: the float activations ``[M, K]`` (float32/bfloat16/float16, unit column
            stride), quantized inside the GEMV as
            :func:`kernels.quant.triton_activations.quantize_activations` would (one
            launch; the same result bit for bit at the same tiling); or that function's
            :class:`Q8Activations` of them, read as they are (a second launch,
            the codes shared by several calls).
        blocks: uint8 ``[N, K / 256 * block_bytes]``, GGUF blocks row by row.
        type_name: ``"Q4_K"``, ``"Q6_K"`` or ``"Q6_K_P"`` (then the rows are whole 32-bit
            words: an even number of blocks).
        out: where to write ``[M, N]`` (``x``'s dtype, unit column stride), else a new tensor.
        variant: constexprs of a forced tiling: ``SPLIT`` (Q4_K: a thread holds whole
            runs), ``PREFETCH`` (the next step's weight words loaded ahead), ``ABL`` (timing a stage left out; the result is then wrong).
        tiling: ``block_n``, ``split_k``, ``blocks_per_step``, ``num_warps``, a forced
            tiling (tests, sweeps; :class:`~kernels.quant.triton_decode.GemvTiling`); by
            default autotuned on CUDA when the rows fill the SMs twice over, else K is split.

    Returns:
        ``[M, N]`` in ``x``'s dtype (float32 accumulation).

    Raises:
        ValueError: another type, blocks that do not hold rows of ``K`` weights, or float
            activations that are not 2-D with a unit column stride.
    """
    return int8_gemv_parts(x, [(blocks, type_name)], out=out, variant=variant, **tiling)


class _Part(NamedTuple):
    """One part's kernel arguments: its type's code, rows, the blocks as 32-bit words,
    16-bit halves and bytes, and its row stride in each."""

    code: int
    rows: int
    words: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, int, int]


def _part(blocks: torch.Tensor, type_name: str, k: int) -> _Part:
    if type_name not in INT8_TYPES:
        raise ValueError(f"the int8 GEMV reads {', '.join(INT8_TYPES)}, not {type_name}")
    fmt = block_format(type_name)
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // 256 * fmt.block_bytes \
            or k % 256 or blocks.stride(1) != 1 or blocks.stride(0) % (4 if fmt.code == 8 else 2):
        raise ValueError(f"{type_name} blocks {blocks.dtype} {tuple(blocks.shape)} do not hold rows of K={k} weights")
    # The same bytes seen as 32- and 16-bit words: aligned word loads (Q4_K's 144-byte
    # blocks) and Q6_K's halves; the bytes' own view reads the scales.
    flat = blocks.as_strided((blocks.stride(0) * (n - 1) + blocks.shape[1],), (1,))
    w32 = flat[: flat.numel() // 4 * 4].view(torch.int32)
    w16 = flat[: flat.numel() // 2 * 2].view(torch.int16)
    # Row strides in bytes, 32- and 16-bit words (Q6_K's word view is unused when the
    # rows are not whole words; Q6_K_P's rows always are).
    return _Part(fmt.code, n, (w32, w16, blocks), (blocks.stride(0), blocks.stride(0) // 4, blocks.stride(0) // 2))


def int8_gemv_parts(
    x: torch.Tensor | Q8Activations,
    parts: list[tuple[torch.Tensor, str]],
    *,
    out: torch.Tensor | None = None,
    variant: dict | None = None,
    **tiling: Unpack[GemvTiling],
) -> torch.Tensor:
    """:func:`int8_gemv` of a weight stacked from one or two parts of (possibly)
    different types, in one launch: a fused projection whose shards differ in type (a
    Q4_K_M file's q/k in Q4_K over v in Q6_K). Each program's ``block_n`` rows are of one
    part; the first part's columns come first in the output.

    Args:
        x, variant, tiling: as :func:`int8_gemv`'s
            (one tiling for both parts; ``SPLIT`` acts on a Q4_K part only).
        parts: ``[(blocks, type_name)]``, one or two, top to bottom, each as
            :func:`int8_gemv`'s ``blocks`` and ``type_name`` (the same ``K``).
        out: where to write ``[M, N0 + N1]`` (``x``'s dtype, unit column stride), else a
            new tensor.

    Returns:
        ``[M, N0 + N1]`` in ``x``'s dtype: each part's columns equal :func:`int8_gemv`
        of that part at the same tiling, bit for bit.

    Raises:
        ValueError: no part or more than two, or what :func:`int8_gemv` refuses.
    """
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"the int8 GEMV takes one or two parts in a launch, not {len(parts)}")
    quant_x = not isinstance(x, Q8Activations)
    if quant_x and (x.dim() != 2 or x.stride(1) != 1 or not x.dtype.is_floating_point):
        raise ValueError(f"want float activations [M, K] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape if quant_x else x.codes.shape
    first, *rest = [_part(blocks, type_name, k) for blocks, type_name in parts]
    # One part: the second's arguments are the first's, unused (QT1 = 0).
    second = rest[0] if rest else first._replace(code=0, rows=0)
    n = first.rows + second.rows
    nblocks = k // 256
    device = first.words[2].device
    result = output_for(first.words[2].new_empty((m, 0), dtype=x.dtype), n, out)
    if quant_x:  # the scales' and sums' pointers are unused: x stands in for them
        acts = (x, x, x)
        strides = (x.stride(0), 0, 0)
    else:
        acts = (x.codes.view(torch.int32), x.scales, x.sums)
        strides = (x.codes.stride(0) // 4, x.scales.stride(0), x.sums.stride(0))

    def tiles(rows_per_program: int) -> int:
        return triton.cdiv(first.rows, rows_per_program) + triton.cdiv(second.rows, rows_per_program)

    def launch(kernel, grid, dest, per_split, **constexprs):
        kernel[grid](*acts, *first.words, dest, m, first.rows, k, *first.strides, per_split, *strides, dest.stride(-2),
                     *second.words, second.rows, *second.strides, QT=first.code, QT1=second.code, QUANT_X=quant_x,
                     ASM=ptx_enabled(device), **pdl.launch_args(device), **constexprs)

    forced = gemv_tiling(tiling, device, n)
    if forced is None:
        launch(_tuned, lambda meta: (m * tiles(meta["BLOCK_N"]), 1), result, nblocks, PARTIALS=False)
        return result
    block_n, kb, split_k, num_warps = forced
    per_split, split = split_k_ranges(nblocks, kb, m * tiles(block_n), device, split_k)
    dest = split_output(result, split)
    launch(_int8_gemv_kernel, (m * tiles(block_n), split), dest, per_split, BLOCK_N=block_n, KB=kb, PARTIALS=split > 1,
           num_warps=num_warps, **(variant or {}))
    return sum_partials(result, dest)
