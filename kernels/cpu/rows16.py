"""Q4_0/Q4_1/Q8_0 and K-quant blocks interleaved by 16 weight rows (``rows16.c``): the layout
a CPU with AVX-512 gives a projection's blocks at load, so that one register's 16 lanes
are 16 weight rows and a block's scales one load. The same bytes as the GGUF blocks,
reordered; :func:`interleave` writes it and :func:`deinterleave` undoes it (the tests'
reference).

A chunk holds block ``b`` of rows ``16g .. 16g + 15``, chunks in the order ``(g, b)``: the
16 rows' float16 ``d`` (and for Q4_1 their ``m``), then their codes; Q4 code byte
``32k + 2j + t`` holds weight ``2k + t`` of row ``j`` in its low nibble and ``2k + 16 + t``
in its high one, Q8_0 code byte ``32k + 2j + t`` is weight ``2k + t`` of row ``j``.

Q4_K's chunk is super-block ``s`` of the 16 rows (2,304 bytes): their float16 ``d``, then
``dmin``, then 12 planes of 16 bytes (plane ``p``: byte ``p`` of each row's packed
scales), then code byte ``512p + 32k + 2j + t`` = the file's ``qs[32p + 2k + t]`` of row
``j`` (low nibble: weight ``2k + t`` of sub-block ``2p``; high: of sub-block ``2p + 1``).
Q5_K's chunk is Q4_K's (its codes from the file's ``qs``) with 512 bytes after it: byte
``32k + 2j + t`` is the file's ``qh[2k + t]`` of row ``j``. Q6_K's (3,360 bytes): the 16
``d``, the int8 scales by sub-block, the low 4 bits (byte ``(n, k, j, t)`` is ``ql[64n + 2k
+ t]`` of row ``j``), then the top 2 bits of steps ``2m`` and ``2m + 1``, a byte a row and
``t`` (``rows16.c`` says the bits). The K-quants' products take 16-bit activation codes,
so they interleave only while the ``cpu_kquant_act_bits`` switch is 16.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import gguf
import torch

from kernels.cpu.threads import default_threads
from kernels.quant.formats import block_format
from kernels.switches import current

ROWS = 16
# The C kernels' type id of interleaved blocks: the GGUF type's ggml id | this flag (blocks.h).
FLAG = 0x100
SUFFIX = "x16"
# The GGUF types that interleave, and the names their interleaved blocks go by.
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# The K-quants among them: their products take 16-bit activation codes.
KQUANTS = ("Q4_K", "Q5_K", "Q6_K")
NAMES = {f"{t}{SUFFIX}": t for t in TYPES}


def available(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s build multiplies interleaved blocks (it has AVX-512 BW)."""
    return bool(lib.hr_rows16_available())


def takes(type_name: str, rows: int) -> bool:
    """Whether ``rows`` rows of ``type_name`` blocks interleave: a type of :data:`TYPES`,
    ``rows`` a multiple of 16; Q4_K only while the ``cpu_kquant_act_bits`` switch is 16
    (its interleaved product takes 16-bit codes, and 8 is the switch's to choose)."""
    if type_name in KQUANTS and current().cpu_kquant_act_bits != "16":
        return False
    return _fits(type_name, rows)


def _fits(type_name: str, rows: int) -> bool:
    return type_name in TYPES and rows % ROWS == 0 and rows > 0


def _split(type_name: str) -> tuple[int, int]:
    """(bytes of scales, bytes of codes) of one block of ``type_name``."""
    fmt = block_format(type_name)
    scale_bytes = 4 if type_name == "Q4_1" else 2
    return scale_bytes, fmt.block_bytes - scale_bytes


def interleave(blocks: torch.Tensor, type_name: str, lib: ctypes.CDLL | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[N, K / 32 * block_bytes]`` GGUF blocks of ``type_name`` as interleaved blocks
    of the same shape, in ``out`` (uint8, that shape, contiguous; a new tensor when None;
    ``blocks`` is left as it is). With ``lib`` (:func:`kernels.cpu.build.load`'s) the C
    pass over the threads writes them (``interleave.c``, what a CPU engine's load takes);
    without, torch's reshapes (the reference the tests hold it to).

    Raises:
        ValueError: a type not in :data:`TYPES`, ``N`` not a multiple of 16, or an ``out``
            of another shape.
    """
    n, row_bytes = blocks.shape
    if not _fits(type_name, n):
        raise ValueError(f"interleave: {n} rows of {type_name} blocks; takes {', '.join(TYPES)} in multiples of {ROWS}")
    if out is not None and (out.shape != blocks.shape or out.dtype != torch.uint8 or not out.is_contiguous()):
        raise ValueError(f"interleave: out {out.dtype} {tuple(out.shape)} for blocks {tuple(blocks.shape)}")
    if lib is None:
        got = _interleave_torch(blocks, type_name)
        return got if out is None else out.copy_(got)
    src = blocks.contiguous()
    out = torch.empty_like(src) if out is None else out
    if lib.hr_rows16_interleave(int(gguf.GGMLQuantizationType[type_name]), src.data_ptr(), n, row_bytes,
                                out.data_ptr(), default_threads()) != 0:
        raise ValueError(f"interleave: rows of {row_bytes} bytes are not whole {type_name} blocks")
    return out


def _interleave_torch(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    n, row_bytes = blocks.shape
    if type_name in ("Q4_K", "Q5_K"):
        return _interleave_q4k(blocks, five=type_name == "Q5_K")
    if type_name == "Q6_K":
        return _interleave_q6k(blocks)
    scale_bytes, code_bytes = _split(type_name)
    bb = scale_bytes + code_bytes
    nb = row_bytes // bb
    b = blocks.view(n // ROWS, ROWS, nb, bb).permute(0, 2, 1, 3)  # [g, b, row, byte]
    scales = b[..., :scale_bytes].reshape(n // ROWS, nb, ROWS, scale_bytes // 2, 2)
    scales = scales.permute(0, 1, 3, 2, 4).reshape(n // ROWS, nb, ROWS * scale_bytes)  # d[16] (then m[16])
    qs = b[..., scale_bytes:]
    if type_name == "Q8_0":
        codes = qs.reshape(n // ROWS, nb, ROWS, 16, 2).permute(0, 1, 3, 2, 4)  # [g, b, k, row, t]
    else:
        weights = torch.cat([qs & 15, qs >> 4], dim=-1)  # [g, b, row, 32]: weights 0-15, 16-31
        w = weights.reshape(n // ROWS, nb, ROWS, 2, 8, 2)  # [g, b, row, half, k, t]
        codes = (w[:, :, :, 0] | (w[:, :, :, 1] << 4)).permute(0, 1, 3, 2, 4)  # [g, b, k, row, t]
    out = torch.cat([scales, codes.reshape(n // ROWS, nb, ROWS * code_bytes)], dim=-1)
    return out.contiguous().view(n, row_bytes)


def _interleave_q4k(blocks: torch.Tensor, five: bool = False) -> torch.Tensor:
    """Q4_K's chunks (the module's docstring): d, dmin, the 12 scale planes, the codes;
    ``five``: Q5_K's, its fifth bits after them."""
    n, row_bytes = blocks.shape
    bb = 176 if five else 144
    g, nsb = n // ROWS, row_bytes // bb
    b = blocks.view(g, ROWS, nsb, bb).permute(0, 2, 1, 3)  # [g, s, row, byte]
    d, dmin = b[..., 0:2].reshape(g, nsb, 32), b[..., 2:4].reshape(g, nsb, 32)
    planes = b[..., 4:16].transpose(2, 3).reshape(g, nsb, 192)  # [g, s, plane, row]
    codes = b[..., bb - 128:].reshape(g, nsb, ROWS, 4, 16, 2).permute(0, 1, 3, 4, 2, 5)  # [g, s, p, k, row, t]
    parts = [d, dmin, planes, codes.reshape(g, nsb, 2048)]
    if five:
        parts.append(b[..., 16:48].reshape(g, nsb, ROWS, 16, 2).permute(0, 1, 3, 2, 4).reshape(g, nsb, 512))
    return torch.cat(parts, dim=-1).contiguous().view(n, row_bytes)


def _chunks(blocks: torch.Tensor, block_bytes: int) -> tuple[int, int, torch.Tensor]:
    """(groups, super-blocks a row, the chunks ``[g, s, 16 x block_bytes]``) of interleaved
    K-quant blocks."""
    n, row_bytes = blocks.shape
    g, nsb = n // ROWS, row_bytes // block_bytes
    return g, nsb, blocks.reshape(g, nsb, ROWS * block_bytes)


def _deinterleave_q4k(blocks: torch.Tensor, five: bool = False) -> torch.Tensor:
    g, nsb, c = _chunks(blocks, 176 if five else 144)
    d = c[..., 0:32].reshape(g, nsb, ROWS, 2)
    dmin = c[..., 32:64].reshape(g, nsb, ROWS, 2)
    scales = c[..., 64:256].reshape(g, nsb, 12, ROWS).transpose(2, 3)
    qs = c[..., 256:2304].reshape(g, nsb, 4, 16, ROWS, 2).permute(0, 1, 4, 2, 3, 5).reshape(g, nsb, ROWS, 128)
    parts = [d, dmin, scales, qs]
    if five:
        parts.insert(3, c[..., 2304:].reshape(g, nsb, 16, ROWS, 2).permute(0, 1, 3, 2, 4).reshape(g, nsb, ROWS, 32))
    out = torch.cat(parts, dim=-1).permute(0, 2, 1, 3)  # [g, row, s, byte]
    return out.contiguous().view(blocks.shape)


def _interleave_q6k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K's chunks (the module's docstring): d, the scales by sub-block, ql, qh."""
    n, row_bytes = blocks.shape
    g, nsb = n // ROWS, row_bytes // 210
    b = blocks.view(g, ROWS, nsb, 210).permute(0, 2, 1, 3)  # [g, s, row, byte]
    d = b[..., 208:210].reshape(g, nsb, 32)
    scales = b[..., 192:208].transpose(2, 3).reshape(g, nsb, 256)  # [g, s, sub-block, row]
    ql = b[..., :128].reshape(g, nsb, ROWS, 2, 32, 2).permute(0, 1, 3, 4, 2, 5)  # [g, s, half, k, row, t]
    # Each weight's top 2 bits, by half and weight (qh[l] holds those of l, l + 32, l + 64, l + 96).
    qh = b[..., 128:192].reshape(g, nsb, ROWS, 2, 1, 32)
    top = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [g, s, row, half, 4, 32]
    top = top.reshape(g, nsb, ROWS, 2, 128)
    lo, hi = (top[..., :64].reshape(g, nsb, ROWS, 2, 16, 2, 2), top[..., 64:].reshape(g, nsb, ROWS, 2, 16, 2, 2))
    packed = lo[..., 0, :] | (hi[..., 0, :] << 2) | (lo[..., 1, :] << 4) | (hi[..., 1, :] << 6)  # [g, s, row, half, m, t]
    packed = packed.permute(0, 1, 3, 4, 2, 5)  # [g, s, half, m, row, t]
    out = torch.cat([d, scales, ql.reshape(g, nsb, 2048), packed.reshape(g, nsb, 1024)], dim=-1)
    return out.contiguous().view(n, row_bytes)


def _deinterleave_q6k(blocks: torch.Tensor) -> torch.Tensor:
    g, nsb, c = _chunks(blocks, 210)
    d = c[..., 0:32].reshape(g, nsb, ROWS, 2)
    scales = c[..., 32:288].reshape(g, nsb, 16, ROWS).transpose(2, 3)
    ql = c[..., 288:2336].reshape(g, nsb, 2, 32, ROWS, 2).permute(0, 1, 4, 2, 3, 5).reshape(g, nsb, ROWS, 128)
    packed = c[..., 2336:].reshape(g, nsb, 2, 16, ROWS, 2).permute(0, 1, 4, 2, 3, 5)  # [g, s, row, half, m, t]
    lo = torch.stack([packed & 3, (packed >> 4) & 3], dim=-2)  # [g, s, row, half, m, 2, t]
    hi = torch.stack([(packed >> 2) & 3, packed >> 6], dim=-2)
    top = torch.cat([lo.reshape(g, nsb, ROWS, 2, 64), hi.reshape(g, nsb, ROWS, 2, 64)], dim=-1)
    top = top.reshape(g, nsb, ROWS, 2, 4, 32)
    qh = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    out = torch.cat([ql, qh.reshape(g, nsb, ROWS, 64), scales, d], dim=-1).permute(0, 2, 1, 3)
    return out.contiguous().view(blocks.shape)


def deinterleave(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """:func:`interleave` undone: uint8 ``[N, K / 32 * block_bytes]`` GGUF blocks."""
    if type_name in ("Q4_K", "Q5_K"):
        return _deinterleave_q4k(blocks, five=type_name == "Q5_K")
    if type_name == "Q6_K":
        return _deinterleave_q6k(blocks)
    n, row_bytes = blocks.shape
    scale_bytes, code_bytes = _split(type_name)
    bb = scale_bytes + code_bytes
    nb = row_bytes // bb
    c = blocks.reshape(n // ROWS, nb, ROWS * bb)
    scales = c[..., : ROWS * scale_bytes].reshape(n // ROWS, nb, scale_bytes // 2, ROWS, 2).permute(0, 1, 3, 2, 4)
    scales = scales.reshape(n // ROWS, nb, ROWS, scale_bytes)
    codes = c[..., ROWS * scale_bytes:]
    if type_name == "Q8_0":
        qs = codes.reshape(n // ROWS, nb, 16, ROWS, 2).permute(0, 1, 3, 2, 4).reshape(n // ROWS, nb, ROWS, 32)
    else:
        packed = codes.reshape(n // ROWS, nb, 8, ROWS, 2).permute(0, 1, 3, 2, 4)  # [g, b, row, k, t]
        weights = torch.stack([packed & 15, packed >> 4], dim=3).reshape(n // ROWS, nb, ROWS, 32)
        qs = weights[..., :16] | (weights[..., 16:] << 4)
    out = torch.cat([scales, qs], dim=-1).permute(0, 2, 1, 3)  # [g, row, b, byte]
    return out.contiguous().view(n, row_bytes)


_HUGE = 2 << 20  # an x86-64 huge page
_MADV_HUGEPAGE = 14  # Linux's madvise advice


def huge_buffer(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """uint8 tensors of ``shapes``, one after another in one new buffer aligned to 2 MiB
    and, on Linux, advised to take huge pages; not written (a page is resident once
    written, so a caller that copies its parts in one at a time and drops each old one
    holds one part more, not all of them twice).

    A decode step reads its layers' projections one after another; as separate tensors
    each starts a new stream at an unrelated address, and 66 MB of them in 4 KiB pages
    cost a TLB miss every 4 KiB. Measured on 2 Zen 4 cores, one thread: the default
    model's 120 projections 3.48 ms as separate tensors, 2.74 ms as consecutive slices of
    one (docs/cpu.md)."""
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    total = sum(sizes)
    raw = torch.empty(total + _HUGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE
    buf = raw[start:start + total]
    if total and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(total), _MADV_HUGEPAGE)  # advice only
    views, at = [], 0
    for shape, n in zip(shapes, sizes, strict=True):
        views.append(buf[at:at + n].view(shape))
        at += n
    return views


def release_freed() -> None:
    """Freed heap memory handed back to the system now (glibc's ``malloc_trim``; nothing
    elsewhere), so that copying parts into :func:`huge_buffer` one at a time does not hold
    the old ones' pages too."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
