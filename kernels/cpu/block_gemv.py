"""``x @ W.T`` on the CPU with ``W`` in GGUF blocks (Q4_0, Q4_1, Q8_0 in ``block_gemv.c``;
Q4_K, Q5_K, Q6_K in ``kquant.c``): the C kernel and its torch reference.

The kernel quantizes each activation row per block of 32 to int16 codes with a float32
scale (``max|x| / 32767``), multiplies codes by the weights' integer codes exactly and
scales each block's sum (llama.cpp's scheme for these types, with 16-bit activation
codes where it takes 8: see the C file for why). The K-quants take 8-bit codes
(``max|x| / 127``, ``kquant8.c``) where the ``cpu_kquant_act_bits`` switch says 8
(:func:`act_bits`). The reference does the same quantization in torch and the product
in float64 from ``gguf``'s dequantized weights, so the two agree to float32 summation
order; against float32 activations a product moves by at most half a code step
(``max|x_block| / 65534``, or ``/ 254`` with 8-bit codes) per element of a block.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import rows16
from kernels.quant import reference
from kernels.quant.formats import block_format
from kernels.switches import current

GROUP = 32
# ggml's type ids, as block_gemv.c reads them: the types CPU linear layers keep in blocks.
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
# Every type the C row products read (blocks.h): the K-quants too (kquant.c), whose
# blocks of 256 need K a multiple of 256, and MXFP4 (mxfp4.c; gpt-oss's experts).
GEMV_TYPE_IDS = {**TYPE_IDS, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
# Q4_0/Q4_1/Q8_0/Q4_K blocks interleaved by 16 rows (:mod:`kernels.cpu.rows16`), where the
# build has AVX-512.
ROWS16_IDS = {name: GEMV_TYPE_IDS[t] | rows16.FLAG for name, t in rows16.NAMES.items()}
# The products the C kernels take (blocks.h's HR_PATH_*): the fastest the build has (the
# AVX-512 block GEMM of block_gemm.c where the CPU has AVX-512 BW), the plain C one, the
# AVX2 tile.
PATH_BEST, PATH_C, PATH_AVX2 = 0, 1, 2
# A flag on a path (blocks.h's HR_ACT8): the K-quant products take 8-bit activation codes.
ACT8 = 4
KQUANT_NAMES = ("Q4_K", "Q5_K", "Q6_K")
# The types :func:`dequantize_rows` reads.
DEQUANT_IDS = {name: GEMV_TYPE_IDS[name] for name in (*TYPE_IDS, *KQUANT_NAMES)}


def gemv_path(scalar: bool = False) -> int:
    """The ``PATH_*`` a C product takes now: plain C where asked (tests), the AVX2 tile
    while the ``cpu_block_gemm`` switch (:mod:`kernels.switches`) is off, else the
    fastest; with :data:`ACT8` where the ``cpu_kquant_act_bits`` switch is 8."""
    path = PATH_C if scalar else PATH_BEST if current().cpu_block_gemm else PATH_AVX2
    return path | (ACT8 if current().cpu_kquant_act_bits == "8" else 0)


def act_bits(type_name: str) -> int:
    """The bits of the activation codes the C products by ``type_name`` blocks take now:
    8 for a K-quant while the ``cpu_kquant_act_bits`` switch is 8, else 16."""
    return 8 if type_name in KQUANT_NAMES and current().cpu_kquant_act_bits == "8" else 16


def gemm_on_blocks(lib: ctypes.CDLL) -> bool:
    """Whether many activation rows (prefill) take the C kernel on the blocks rather than
    weights dequantized to float32 for torch's GEMM: where the build has the AVX-512
    block GEMM (``hr_simd_level() >= 2``; 1.5-3x torch's float32 GEMM at 64-512 rows on
    2 Zen 4 cores, docs/cpu.md) and the ``cpu_block_gemm`` switch is on."""
    return current().cpu_block_gemm and lib.hr_simd_level() >= 2


def quantize_rows_ref(x: torch.Tensor, bits: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation codes: float32 ``[M, K]`` to int16 codes ``[M, K]`` and
    float32 scales ``dx`` ``[M, K / 32]``, ``x ~ codes * dx`` per block of 32; round half
    to even, as ``nearbyintf``. ``bits`` 16: ``dx = max|x| / 32767`` per block (``K`` a
    multiple of 32). 8: ``|c| <= 127``, ``dx = D / 2**k`` with ``D = max|x| / 127`` of the
    block's group of 256 and ``k`` the largest of 0..6 with ``2**k max|x_block| <=
    max|x_group|`` (``K`` a multiple of 256; ``hr_quantize_row8``)."""
    m, k = x.shape
    blocks = x.float().view(m, k // GROUP, GROUP)
    bmax = blocks.abs().amax(-1)
    if bits == 8:
        gmax = bmax.view(m, -1, 8).amax(-1).repeat_interleave(8, dim=1)
        d = gmax / 127.0
        shift = torch.full_like(bmax, 6.0)
        for s in range(6, 0, -1):  # the largest k with 2**k max|x_block| <= max|x_group|
            shift = torch.where((shift == s) & (bmax * 2.0**s > gmax), s - 1.0, shift)
    else:
        d, shift = bmax / 32767.0, torch.zeros_like(bmax)
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    inv = torch.where(torch.isfinite(inv), inv, 0.0) * 2.0**shift
    inv = torch.where(torch.isfinite(inv), inv, 0.0)
    codes = torch.round(blocks * inv[..., None]).clamp(-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1).to(torch.int16)
    return codes.view(m, k), d * 2.0**-shift


def quantize_rows(lib: ctypes.CDLL, x: torch.Tensor, bits: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C kernel's activation codes (``hr_quantize_row``, or ``hr_quantize_row8`` for
    ``bits`` 8, a row at a time): float32 ``[M, K]`` (``K`` a multiple of 32) to codes
    ``[M, K]`` (int16, or int8), float32 scales and int32 code sums ``[M, K / 32]``;
    :func:`quantize_rows_ref` is its reference.

    Raises:
        ValueError: ``K`` not a multiple of 32 (of 256 for ``bits`` 8).
    """
    x = x.contiguous().float()
    m, k = x.shape
    group = 256 if bits == 8 else GROUP
    if k % group:
        raise ValueError(f"quantize_rows: K={k} is not a multiple of {group} ({bits}-bit codes)")
    # 8 bits: the kernel's 2K bytes a row, the codes first (blocks.h)
    codes = torch.empty(m, 2 * k, dtype=torch.int8) if bits == 8 else torch.empty(m, k, dtype=torch.int16)
    scales = torch.empty(m, k // GROUP, dtype=torch.float32)
    sums = torch.empty(m, k // GROUP, dtype=torch.int32)
    quantize = lib.hr_quantize_row8 if bits == 8 else lib.hr_quantize_row
    for r in range(m):
        quantize(x[r].data_ptr(), k, codes[r].data_ptr(), scales[r].data_ptr(), sums[r].data_ptr())
    return codes[:, :k], scales, sums


def block_gemv_ref(x: torch.Tensor, blocks: torch.Tensor, type_name: str, bits: int | None = None) -> torch.Tensor:
    """Reference of :func:`block_gemv`: float32 ``[M, N]``.

    Args:
        x: float32 ``[M, K]``.
        blocks: uint8 ``[N, K / block_elements * block_bytes]`` of ``type_name``.
        type_name: a key of :data:`GEMV_TYPE_IDS`.
        bits: the activation codes' bits, default those the kernel takes now
            (:func:`act_bits`).
    """
    m, k = x.shape
    codes, d = quantize_rows_ref(x, act_bits(type_name) if bits is None else bits)
    xq = (codes.double().view(m, k // GROUP, GROUP) * d.double()[..., None]).view(m, k)
    w = reference.dequantize(blocks, type_name, k).double()
    return (xq @ w.T).float()


def block_gemv(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor, type_name: str,
               out: torch.Tensor | None = None, threads: int | None = None, scalar: bool = False) -> torch.Tensor:
    """``x @ W.T`` by the C kernel.

    Args:
        lib: the library of :func:`kernels.cpu.build.load`.
        x: float32 ``[M, K]``, ``K`` a multiple of the type's block (32; 256 for the
            K-quants), made contiguous if it is not.
        blocks: uint8 ``[N, K / block_elements * block_bytes]``, contiguous (for a
            ``*x16`` type of :data:`ROWS16_IDS`, interleaved by :mod:`kernels.cpu.rows16`).
        out: float32 ``[M, N]`` view to write (its rows may be wider: ``out.stride(0)``),
            else a new tensor.
        threads: OpenMP threads, default ``torch.get_num_threads()``.
        scalar: the plain C product instead of the vector one (tests); else the product
            :func:`gemv_path` picks.

    Returns:
        ``out``, float32 ``[M, N]``.

    Raises:
        ValueError: a type without the kernel, or shapes that do not match.
    """
    ids = GEMV_TYPE_IDS | ROWS16_IDS
    if type_name not in ids:
        raise ValueError(f"{type_name} has no CPU block kernel; expected one of {', '.join(ids)}")
    x = x.contiguous().float()
    m, k = x.shape
    n = blocks.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    fmt = block_format(rows16.NAMES.get(type_name, type_name))
    row_bytes = k // fmt.block_elements * fmt.block_bytes
    if (k % fmt.block_elements or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes
            or not blocks.is_contiguous() or out.shape != (m, n) or out.stride(1) != 1 or out.dtype != torch.float32):
        raise ValueError(f"block_gemv: {type_name} blocks {blocks.dtype} {tuple(blocks.shape)}, x {tuple(x.shape)} "
                         f"and out {tuple(out.shape)} do not match (rows of K={k} take {row_bytes} bytes)")
    work = torch.empty(lib.hr_work_bytes(m, k), dtype=torch.uint8)
    done = lib.hr_block_gemv(ids[type_name], x.data_ptr(), m, k, blocks.data_ptr(), n, out.data_ptr(),
                             out.stride(0), work.data_ptr(), threads or torch.get_num_threads(), gemv_path(scalar))
    if done != 0:
        raise ValueError(f"block_gemv refused {type_name} blocks of K={k} and N={n} (interleaved blocks take N a "
                         "multiple of 16 and a build with AVX-512: kernels.cpu.rows16.available)")
    return out


def dequantize_rows(lib: ctypes.CDLL, blocks: torch.Tensor, type_name: str, lo: int, hi: int,
                    out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """Rows ``lo`` to ``hi`` of ``blocks`` (uint8 ``[N, K / block_elements * block_bytes]``
    of a type of :data:`DEQUANT_IDS`) as float32 ``[hi - lo, K]``, by the C kernel
    (``out``: a contiguous float32 buffer of at least that many elements to write into);
    the values of ``gguf``'s dequantizer, up to the rounding of a fused multiply-add.

    Raises:
        ValueError: a type without the kernel, or rows outside ``blocks``.
    """
    if type_name not in DEQUANT_IDS:
        raise ValueError(f"{type_name} has no CPU block kernel; expected one of {', '.join(DEQUANT_IDS)}")
    fmt = block_format(type_name)
    k = blocks.shape[1] // fmt.block_bytes * fmt.block_elements
    row_bytes = k // fmt.block_elements * fmt.block_bytes
    if (not 0 <= lo <= hi <= blocks.shape[0] or not blocks.is_contiguous() or blocks.dtype != torch.uint8
            or blocks.dim() != 2 or blocks.shape[1] != row_bytes):
        raise ValueError(f"dequantize_rows: rows {lo}-{hi} of {type_name} blocks {blocks.dtype} {tuple(blocks.shape)}")
    n = hi - lo
    if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < n * k):
        raise ValueError(f"dequantize_rows: out {out.dtype} {tuple(out.shape)} cannot hold {n} x {k} float32")
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(-1)[: n * k].view(n, k)
    if lib.hr_dequantize_rows(DEQUANT_IDS[type_name], blocks.data_ptr(), k, lo, hi, out.data_ptr(),
                              threads or torch.get_num_threads()) != 0:
        raise ValueError(f"dequantize_rows refused {type_name} blocks of K={k}")
    return out


def dequantize_ids(lib: ctypes.CDLL, blocks: torch.Tensor, type_name: str, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[n]``) of ``blocks`` as float32 ``[n, K]``, gguf's values: a
    type of :data:`DEQUANT_IDS` gathered, then :func:`dequantize_rows`; Q4_K or Q6_K
    blocks interleaved by 16 rows (``Q4_Kx16``, ``Q6_Kx16``: a tied head's embeddings,
    :mod:`kernels.cpu.rows16`) by the C lookup, which puts each row's blocks back first.

    Raises:
        ValueError: a type without the lookup, or an id outside the rows.
    """
    if type_name in DEQUANT_IDS:
        rows = blocks.index_select(0, ids)
        return dequantize_rows(lib, rows, type_name, 0, rows.shape[0])
    base = rows16.NAMES.get(type_name)
    if base not in rows16.KQUANTS or not blocks.is_contiguous():
        raise ValueError(f"dequantize_ids: {type_name} blocks; takes {', '.join((*DEQUANT_IDS, 'Q4_Kx16', 'Q6_Kx16'))}")
    fmt = block_format(base)
    k = blocks.shape[1] // fmt.block_bytes * fmt.block_elements
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if lib.hr_rows16_dequantize(GEMV_TYPE_IDS[base], blocks.data_ptr(), k, blocks.shape[0], ids.data_ptr(),
                                ids.numel(), out.data_ptr()) != 0:
        raise ValueError(f"dequantize_ids: ids {ids.tolist()[:8]} of {blocks.shape[0]} {type_name} rows of K={k}")
    return out
