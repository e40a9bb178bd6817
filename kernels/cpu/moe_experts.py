"""A mixture-of-experts layer's CPU experts for one step over their GGUF blocks, in one
call: the C kernel (``moe_experts.c``) and its torch reference.

The caller gives the routed ``(token, expert, router weight)`` pairs to run on the CPU;
the kernel quantizes each token's hidden state once (int16 codes per block of 32, as
:mod:`kernels.cpu.block_gemv`; int8 codes where the ``cpu_kquant_act_bits`` switch is 8
and the projections reading them are K-quants), runs each expert's gate and up over its blocks for all of
its pairs at once, ``silu(gate) * up`` in float32, quantizes that the same way, runs down,
and adds ``weight * y`` into the token's output row. The product of one block moves by at
most ``max|x_block| / 65534 * sum|w_block|`` (8-bit codes: ``/ 254``) against float32 activations
(``kquant.c``), at gate/up and again at down. gpt-oss's experts (MXFP4 blocks) add their
biases to gate/up and down and take the clamped SwiGLU in place of SiLU-and-mul, in the
same call (``biases``, ``activation``).

:func:`moe_experts_ref` computes the same arithmetic in torch: activations quantized by
:func:`~kernels.cpu.block_gemv.quantize_rows_ref`, products in float64 from ``gguf``'s
dequantized weights, SiLU-and-mul in float64, so the two agree to float32 summation order
(and, where a float32 ``h`` and the float64 one round to neighbouring codes, by one code
of ``h``'s block).
"""

from __future__ import annotations

import ctypes
import os

import torch

from kernels.activation.reference import ClampedSwiGLU
from kernels.cpu.block_gemv import GEMV_TYPE_IDS, act_bits, gemv_path, quantize_rows_ref
from kernels.moe.reference import ExpertBiases
from kernels.quant import reference


def default_threads() -> int:
    """OpenMP threads for a call: torch's intra-op count (what the engine fits to the cores
    other programs leave free between steps), never above the cores this process may run
    on (``os.sched_getaffinity``; torch's own default counts the machine's)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), usable))


def takes(types: tuple[str, str, str]) -> bool:
    """Whether the kernel reads gate, up and down of these GGML types."""
    return all(t in GEMV_TYPE_IDS for t in types)


def group_pairs(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
    """The pairs sorted by expert (stable) and their groups, as the kernel takes them:
    ``(token int32 [P], weight float32 [P], expert int32 [G], start int32 [G + 1])``."""
    experts = experts.to(torch.int64)
    order = torch.argsort(experts, stable=True)
    ids, counts = torch.unique_consecutive(experts[order], return_counts=True)
    start = torch.zeros(len(ids) + 1, dtype=torch.int32)
    start[1:] = counts.cumsum(0)
    return (tokens[order].to(torch.int32).contiguous(), weights[order].to(torch.float32).contiguous(),
            ids.to(torch.int32).contiguous(), start)


def moe_experts(lib: ctypes.CDLL, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: tuple[str, str, str],
                out: torch.Tensor | None = None, threads: int | None = None, scalar: bool = False,
                biases: ExpertBiases | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """``out[t] += w * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for every pair ``(t, e, w)``
    (with ``biases`` each projection's added, with ``activation`` it in place of
    SiLU-and-mul: gpt-oss's experts).

    Args:
        lib: the library of :func:`kernels.cpu.build.load`.
        x: float32 ``[T, H]`` hidden states (CPU).
        tokens, experts: int ``[P]``, each pair's token (below ``T``) and expert (below ``E``).
        weights: ``[P]`` router weights.
        gate, up: uint8 ``[E, I, H / block_elements * block_bytes]`` blocks; down: uint8
            ``[E, H, I / ...]``, contiguous (the GGUF's ``ffn_*_exps``).
        types: GGML type names of gate, up and down (keys of
            :data:`~kernels.cpu.block_gemv.GEMV_TYPE_IDS`).
        out: float32 ``[T, H]`` contiguous to add into, else a new zeroed one.
        threads: OpenMP threads, default :func:`default_threads`.
        scalar: the plain C products instead of the vector ones (tests).
        biases: ``gate_up`` ``[E, 2I]`` (gate half first) and ``down`` ``[E, H]``, any
            float dtype (read as float32).
        activation: gpt-oss's clamped SwiGLU, or None for SiLU-and-mul.

    Returns:
        ``out``, float32 ``[T, H]``.

    Raises:
        ValueError: a type without a kernel, blocks that do not hold ``[E, I, H]`` weights,
            or pairs naming a token or an expert outside ``x`` or the stacks.
    """
    from kernels.moe.quant_reference import check_cache, check_expert_blocks

    if not takes(types):
        raise ValueError(f"CPU experts of types {'/'.join(types)}: the C kernels read {', '.join(GEMV_TYPE_IDS)}")
    x = x.contiguous().float()
    t_count, hidden = x.shape
    inter = gate.shape[1]
    check_expert_blocks(gate, up, down, types, hidden, inter)
    check_cache(None, None, gate, up, down, biases)
    if out is None:
        out = torch.zeros(t_count, hidden, dtype=torch.float32)
    if out.shape != (t_count, hidden) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"moe_experts: out {out.dtype} {tuple(out.shape)} is not float32 {(t_count, hidden)}")
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= t_count or int(experts.min()) < 0
                        or int(experts.max()) >= gate.shape[0]):
        raise ValueError(f"moe_experts: a pair names a token outside 0..{t_count - 1} or an expert outside "
                         f"0..{gate.shape[0] - 1}")
    tok, w, ids, start = group_pairs(tokens, experts, weights)
    blocks = [b.contiguous() for b in (gate, up, down)]
    work = torch.empty(lib.hr_moe_work_bytes(t_count, hidden, inter, len(tok)), dtype=torch.uint8)
    bias = [] if biases is None else [b.detach().float().contiguous() for b in (biases.gate_up, biases.down)]
    done = lib.hr_moe_experts(x.data_ptr(), t_count, hidden, inter, tok.data_ptr(), w.data_ptr(), len(tok),
                              ids.data_ptr(), start.data_ptr(), len(ids), *(b.data_ptr() for b in blocks),
                              *(GEMV_TYPE_IDS[t] for t in types), *([b.data_ptr() for b in bias] or [None, None]),
                              0.0 if activation is None else activation.alpha,
                              0.0 if activation is None else activation.limit, out.data_ptr(), work.data_ptr(),
                              threads or default_threads(), gemv_path(scalar))
    if done != 0:
        raise ValueError(f"moe_experts refused {'/'.join(types)} experts of H={hidden}, I={inter}")
    return out


def _quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, d = quantize_rows_ref(x.float(), bits)
    m, k = x.shape
    return (codes.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)


def moe_experts_ref(x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: tuple[str, str, str],
                    biases: ExpertBiases | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Reference of :func:`moe_experts` (arguments as there): float32 ``[T, H]``."""
    t_count, hidden = x.shape
    inter = gate.shape[1]
    out = torch.zeros(t_count, hidden, dtype=torch.float64)
    # the kernel's codes: 8-bit hidden rows only where both gate and up take them
    xq = _quantized(x, max(act_bits(types[0]), act_bits(types[1])))
    for e in torch.unique(experts).tolist():
        sel = torch.where(experts == e)[0]
        rows = xq[tokens[sel].long()]
        g = rows @ reference.dequantize(gate[e], types[0], hidden).double().T
        u = rows @ reference.dequantize(up[e], types[1], hidden).double().T
        if biases is not None:
            g, u = g + biases.gate_up[e, :inter].double(), u + biases.gate_up[e, inter:].double()
        h = _quantized((g * torch.sigmoid(g) * u if activation is None else activation(torch.cat((g, u), -1))).float(),
                       act_bits(types[2]))
        y = h @ reference.dequantize(down[e], types[2], inter).double().T
        if biases is not None:
            y = y + biases.down[e].double()
        out.index_add_(0, tokens[sel].long(), y * weights[sel].double()[:, None])
    return out.float()
