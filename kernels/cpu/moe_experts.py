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

A projection's type may name its blocks interleaved by 16 rows (``Q4_Kx16`` and the
others of :data:`kernels.cpu.rows16.NAMES`: each expert's rows as :func:`interleave_stack`
writes them, what a CPU engine keeps where the build has AVX-512); the kernel multiplies
those by ``rows16.c`` on 16-bit activation codes, whatever the ``cpu_kquant_act_bits``
switch says (as the dense layers' interleaved blocks).

:func:`moe_experts_ref` computes the same arithmetic in torch: activations quantized by
:func:`~kernels.cpu.block_gemv.quantize_rows_ref`, products in float64 from ``gguf``'s
dequantized weights, SiLU-and-mul in float64, so the two agree to float32 summation order
(and, where a float32 ``h`` and the float64 one round to neighbouring codes, by one code
of ``h``'s block).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.activation.reference import ClampedSwiGLU
from kernels.cpu import rows16
from kernels.cpu.block_gemv import GEMV_TYPE_IDS, ROWS16_IDS, act_bits, gemv_path, quantize_rows_ref
from kernels.cpu.threads import default_threads
from kernels.moe.reference import ExpertBiases
from kernels.quant import reference

# Every type name the kernel reads: the GGUF's and the interleaved ones.
TYPE_IDS = GEMV_TYPE_IDS | ROWS16_IDS


def takes(types: tuple[str, str, str]) -> bool:
    """Whether the kernel reads gate, up and down of these GGML types (or their
    interleaved names)."""
    return all(t in TYPE_IDS for t in types)


def file_types(types: tuple[str, ...]) -> tuple[str, ...]:
    """The GGUF type names of ``types`` (an interleaved name's own type)."""
    return tuple(rows16.NAMES.get(t, t) for t in types)


def interleave_stack(stack: torch.Tensor, type_name: str, lib: ctypes.CDLL | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``[E, N, row_bytes]`` experts' blocks of ``type_name`` with each expert's rows
    interleaved by 16 (:func:`kernels.cpu.rows16.interleave`, by the C pass where ``lib``
    is given), in ``out`` (as large) or a new tensor.

    Raises:
        ValueError: as :func:`~kernels.cpu.rows16.interleave` (``N`` not a multiple of 16).
    """
    e, n, row_bytes = stack.shape
    if n % rows16.ROWS:
        raise ValueError(f"interleave_stack: experts of {n} rows; takes multiples of {rows16.ROWS}")
    flat = None if out is None else out.view(e * n, row_bytes)
    return rows16.interleave(stack.reshape(e * n, row_bytes), type_name, lib, out=flat).view(e, n, row_bytes)


def file_stack(stack: torch.Tensor, type_name: str) -> torch.Tensor:
    """Experts' blocks of ``type_name`` as the file holds them: interleaved ones
    (``Q4_Kx16``...) put back (:func:`kernels.cpu.rows16.deinterleave`), others as they are."""
    if type_name not in rows16.NAMES:
        return stack
    e, n, row_bytes = stack.shape
    return rows16.deinterleave(stack.reshape(e * n, row_bytes), rows16.NAMES[type_name]).view(e, n, row_bytes)


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
        types: GGML type names of gate, up and down (keys of :data:`TYPE_IDS`: a
            ``*x16`` name for experts interleaved by :func:`interleave_stack`).
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
    x, out, experts_args, _kept = _prepared(x, out, gate, up, down, types, biases, activation)
    t_count = x.shape[0]
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= t_count or int(experts.min()) < 0
                        or int(experts.max()) >= gate.shape[0]):
        raise ValueError(f"moe_experts: a pair names a token outside 0..{t_count - 1} or an expert outside "
                         f"0..{gate.shape[0] - 1}")
    tok, w, ids, start = group_pairs(tokens, experts, weights)
    work = torch.empty(lib.hr_moe_work_bytes(t_count, x.shape[1], gate.shape[1], len(tok)), dtype=torch.uint8)
    done = lib.hr_moe_experts(x.data_ptr(), t_count, x.shape[1], gate.shape[1], tok.data_ptr(), w.data_ptr(), len(tok),
                              ids.data_ptr(), start.data_ptr(), len(ids), *experts_args, out.data_ptr(),
                              work.data_ptr(), threads or default_threads(), gemv_path(scalar))
    _refused(done, types, x.shape[1], gate.shape[1])
    return out


def moe_experts_routed(lib: ctypes.CDLL, x: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None,
                       top_k: int, renormalize: bool, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       types: tuple[str, str, str], out: torch.Tensor | None = None, threads: int | None = None,
                       scalar: bool = False, biases: ExpertBiases | None = None,
                       activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """:func:`moe_experts` on the pairs :func:`kernels.moe.reference.route` makes of the
    router's logits ``x @ router.T + router_bias``, all inside the same C call: the
    logits in float32 over the threads, each token's ``top_k`` experts by softmax
    probability, divided by their sum where ``renormalize`` (ties to the lower expert
    id). A decode step's MoE layer in one call, where the router's GEMV, the routing and
    the grouping of the pairs in torch took a dozen small ops (~0.1-0.2 ms a layer on two
    cores).

    Args:
        router: ``[E, H]`` router weights (read as float32); router_bias: ``[E]`` or None.
        top_k: experts a token, ``1..E``; renormalize: as :func:`~kernels.moe.reference.route`.
        The others: as :func:`moe_experts`.

    Returns:
        ``out``, float32 ``[T, H]``.

    Raises:
        ValueError: as :func:`moe_experts`; a router that is not ``[E, H]`` (its bias not
            ``[E]``) or ``top_k`` outside ``1..E``.
    """
    x, out, experts_args, _kept = _prepared(x, out, gate, up, down, types, biases, activation)
    (t_count, hidden), num_experts = x.shape, gate.shape[0]
    router = router.detach().float().contiguous()
    bias = None if router_bias is None else router_bias.detach().float().contiguous()
    if router.shape != (num_experts, hidden) or (bias is not None and bias.shape != (num_experts,)):
        raise ValueError(f"moe_experts_routed: router {tuple(router.shape)} (bias "
                         f"{None if bias is None else tuple(bias.shape)}) for {num_experts} experts of {hidden}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_experts_routed: top_k {top_k} of {num_experts} experts")
    work = torch.empty(lib.hr_moe_routed_work_bytes(t_count, hidden, gate.shape[1], num_experts, top_k),
                       dtype=torch.uint8)
    done = lib.hr_moe_routed(x.data_ptr(), t_count, hidden, gate.shape[1], router.data_ptr(),
                             None if bias is None else bias.data_ptr(), num_experts, top_k, int(renormalize),
                             *experts_args, out.data_ptr(), work.data_ptr(), threads or default_threads(),
                             gemv_path(scalar))
    _refused(done, types, hidden, gate.shape[1])
    return out


def _prepared(x, out, gate, up, down, types, biases, activation):
    """``x`` as float32 contiguous, ``out`` (a new zeroed one for None), the C call's
    experts arguments (the stacks' addresses, type ids, biases, activation constants) and
    the tensors those addresses point into (the caller holds them until the call
    returns: a contiguous copy or float32 biases live only there), after the checks
    :func:`moe_experts` names."""
    if not takes(types):
        raise ValueError(f"CPU experts of types {'/'.join(types)}: the C kernels read {', '.join(TYPE_IDS)}")
    x = x.contiguous().float()
    t_count, hidden = x.shape
    _check_shapes(tuple(gate.shape), tuple(up.shape), tuple(down.shape), (gate.dtype, up.dtype, down.dtype), types,
                  hidden, None if biases is None else (tuple(biases.gate_up.shape), tuple(biases.down.shape)))
    if out is None:
        out = torch.zeros(t_count, hidden, dtype=torch.float32)
    if out.shape != (t_count, hidden) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"moe_experts: out {out.dtype} {tuple(out.shape)} is not float32 {(t_count, hidden)}")
    if not (gate.is_contiguous() and up.is_contiguous() and down.is_contiguous()):
        gate, up, down = gate.contiguous(), up.contiguous(), down.contiguous()
    bias = [] if biases is None else [b.detach().float().contiguous() for b in (biases.gate_up, biases.down)]
    args = (gate.data_ptr(), up.data_ptr(), down.data_ptr(), *(TYPE_IDS[t] for t in types),
            *([b.data_ptr() for b in bias] or [None, None]),
            0.0 if activation is None else activation.alpha, 0.0 if activation is None else activation.limit)
    return x, out, args, (gate, up, down, *bias)


@functools.lru_cache(maxsize=256)
def _check_shapes(gate: tuple, up: tuple, down: tuple, dtypes: tuple, types: tuple[str, str, str], hidden: int,
                  bias_shapes: tuple | None) -> None:
    """The stacks' and biases' shapes checked (:func:`~kernels.moe.quant_reference.check_expert_blocks`,
    :func:`~kernels.moe.quant_reference.check_cache`), once for each set of shapes: the
    checks read nothing but shapes, dtypes and types."""
    from kernels.moe.quant_reference import check_cache, check_expert_blocks

    meta = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip((gate, up, down), dtypes, strict=True)]
    check_expert_blocks(*meta, file_types(types), hidden, gate[1])
    biases = None if bias_shapes is None else ExpertBiases(*(torch.empty(s, device="meta") for s in bias_shapes))
    check_cache(None, None, *meta, biases)


def _refused(done: int, types: tuple[str, str, str], hidden: int, inter: int) -> None:
    if done != 0:
        raise ValueError(f"moe_experts refused {'/'.join(types)} experts of H={hidden}, I={inter} (interleaved "
                         "blocks take rows a multiple of 16 and a build with AVX-512: kernels.cpu.rows16.available)")


def _quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    codes, d = quantize_rows_ref(x.float(), bits)
    m, k = x.shape
    return (codes.double().view(m, k // 32, 32) * d.double()[..., None]).view(m, k)


def moe_experts_ref(x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, types: tuple[str, str, str],
                    biases: ExpertBiases | None = None, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Reference of :func:`moe_experts` (arguments as there): float32 ``[T, H]``."""
    gate, up, down = (file_stack(w, t) for w, t in zip((gate, up, down), types, strict=True))
    # the kernel's codes: 8-bit hidden rows only where both gate and up take them (16-bit
    # ones for interleaved blocks)
    bits = [act_bits(t) for t in types]
    types = file_types(types)
    t_count, hidden = x.shape
    inter = gate.shape[1]
    out = torch.zeros(t_count, hidden, dtype=torch.float64)
    xq = _quantized(x, max(bits[0], bits[1]))
    for e in torch.unique(experts).tolist():
        sel = torch.where(experts == e)[0]
        rows = xq[tokens[sel].long()]
        g = rows @ reference.dequantize(gate[e], types[0], hidden).double().T
        u = rows @ reference.dequantize(up[e], types[1], hidden).double().T
        if biases is not None:
            g, u = g + biases.gate_up[e, :inter].double(), u + biases.gate_up[e, inter:].double()
        h = _quantized((g * torch.sigmoid(g) * u if activation is None else activation(torch.cat((g, u), -1))).float(),
                       bits[2])
        y = h @ reference.dequantize(down[e], types[2], inter).double().T
        if biases is not None:
            y = y + biases.down[e].double()
        out.index_add_(0, tokens[sel].long(), y * weights[sel].double()[:, None])
    return out.float()


def moe_experts_routed_ref(x: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
                           renormalize: bool, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                           types: tuple[str, str, str], biases: ExpertBiases | None = None,
                           activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Reference of :func:`moe_experts_routed`: the router's logits in float64,
    :func:`kernels.moe.reference.route`, then :func:`moe_experts_ref` on its pairs;
    float32 ``[T, H]``."""
    from kernels.moe.reference import route

    logits = x.double() @ router.double().T + (0 if router_bias is None else router_bias.double())
    weights, ids = route(logits.float(), top_k, renormalize)
    tokens = torch.arange(x.shape[0]).repeat_interleave(top_k)
    return moe_experts_ref(x, tokens, ids.reshape(-1), weights.reshape(-1), gate, up, down, types, biases, activation)
