"""What a model needs, in bytes: weights, KV per token, sampler, activations.

The activation peak is estimated from shapes before the weights load (so a plan that
cannot fit fails early) and measured by :mod:`engine.core.profile` on a GPU after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.common.config import ModelConfig
from engine.kvcache.pool import kv_storage_dtype
from engine.kvcache.ring import SlidingRing, sliding_ring
from engine.kvcache.state_pool import state_bytes_per_request
from engine.loader.weight_size import expert_weight_bytes, layer_weight_bytes, weight_bytes
from engine.memory.plan import Footprint, PlanKnobs
from kernels.attention.kv_store import kv_bytes, kv_dtype_name

if TYPE_CHECKING:
    from engine.loader.weight_size import WeightSize

# Per request and vocabulary entry, in bytes: the float32 logits row (4); the sampler's
# transients on it, a clone (4), sorted values (4) and order (8, int64), the scatter
# back (4), probabilities (4) and exponential race (4); per-request penalty state, the
# int32 counts (4) and bool prompt mask (1). Source: engine/sampling/sampler.py.
SAMPLER_BYTES_PER_VOCAB_ENTRY = 4 + 4 + 4 + 8 + 4 + 4 + 4 + 4 + 1

# The CUDA context, cuBLAS handles and kernels' modules, before a profile measures them:
# about 300-500 MiB on recent drivers (seen 420-510 MiB on an H200 with torch 2.11).
CUDA_RUNTIME_ESTIMATE_BYTES = 512 << 20


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype, ring: SlidingRing | None = None) -> int:
    """Keys and values of one token over the layers with a KV cache, in bytes: what a
    page of the KV pool holds per token, sliding-window layers included (a page holds
    every layer; see :func:`windowed_kv_bytes` for what those need) unless they keep
    only their window in ``ring`` (:func:`kv_ring`): then the other layers only. A block
    format (``q8_0``, ``q4_0``) costs its blocks' bytes: 34 or 18 for each 32 values."""
    if ring is None:
        return kv_bytes(dtype, mc.kv_elements_per_token)
    return (mc.num_kv_layers - len(ring.layers)) * _layer_kv_bytes(mc, dtype)


def _layer_kv_bytes(mc: ModelConfig, dtype: torch.dtype) -> int:
    """One token's keys and values in one layer, in bytes: ``2 * Hkv * D * it``."""
    return 2 * mc.num_kv_heads * kv_bytes(dtype, mc.head_dim)


def kv_ring(mc: ModelConfig, knobs: PlanKnobs) -> SlidingRing | None:
    """The ring in which ``mc``'s sliding-window layers keep only their window
    (:mod:`engine.kvcache.ring`), sized for ``knobs``' prefill chunk and page; None when
    they keep every token: no sliding layer, only sliding layers, ``--sliding-kv-ring
    off``, or what :func:`kv_ring_excluded` names (``auto`` and ``on`` alike)."""
    if knobs.sliding_kv_ring == "off" or kv_ring_excluded(mc, knobs):
        return None
    return sliding_ring(mc.kv_windows, max_chunk=knobs.max_prefill_tokens, page_size=knobs.page_size)


def kv_ring_excluded(mc: ModelConfig, knobs: PlanKnobs) -> str:
    """Why ``mc``'s sliding-window layers keep every token though ``--sliding-kv-ring``
    asks for the ring ("" when nothing excludes it): FlashInfer (its plans read the
    global page table only), a hybrid model (whose prefix checkpoints are its states').
    Tensor parallelism keeps the ring: rank 0 sends every rank the ring's page table and
    slots with each step, and its ring pool's copies and resizes
    (:mod:`engine.core.tp_follow`)."""
    if knobs.attention_backend == "flashinfer":
        return "the FlashInfer attention backend"
    if mc.is_hybrid:
        return "a hybrid linear-attention model"
    return ""


def kv_ring_page_bytes(mc: ModelConfig, dtype: torch.dtype, ring: SlidingRing) -> int:
    """One page of the ring pool over the sliding layers, keys and values, in bytes."""
    return len(ring.layers) * ring.page_size * _layer_kv_bytes(mc, dtype)


def windowed_kv_bytes(mc: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    """Keys and values one sequence of ``tokens`` tokens needs when each sliding-window
    layer keeps only its window, in bytes: ``2 * Hkv * D * it`` per layer and token,
    times ``tokens`` for a global layer and ``min(window, tokens)`` for a sliding one.
    Equal to ``tokens * kv_bytes_per_token`` for a model without sliding layers."""
    per_layer = _layer_kv_bytes(mc, dtype)
    windows = mc.kv_windows or (0,) * mc.num_kv_layers
    return per_layer * sum(min(w, tokens) if w else tokens for w in windows)


def kv_window_note(mc: ModelConfig, dtype: torch.dtype, ring: SlidingRing | None = None, excluded: str = "") -> str:
    """The plan's words on sliding-window layers' KV (empty without them): how many
    layers slide over how many tokens, and how they are priced: in a ring of pages per
    running request (``ring``, the ledger's line of its own), else per token like the
    others, and why where ``--sliding-kv-ring`` asked for the ring (``excluded``:
    :func:`kv_ring_excluded`'s words)."""
    sliding = [w for w in mc.kv_windows if w]
    if not sliding:
        return ""
    window = max(sliding)
    per_layer = _layer_kv_bytes(mc, dtype)
    if ring is not None:
        return (f"{mc.num_kv_layers - len(sliding)} of {mc.num_kv_layers} layers per token; the {len(sliding)} that "
                f"slide over {window:,} tokens keep a ring per running request of up to "
                f"{ring.decode_pages} pages ({ring.decode_pages * kv_ring_page_bytes(mc, dtype, ring):,} bytes) between "
                f"steps and {ring.pages} in a step of a whole prefill chunk, and prefix-cache checkpoints of {ring.checkpoint_pages} pages")
    why = f"; no ring with {excluded}" if excluded else ""
    return (f"{len(sliding)} of {mc.num_kv_layers} layers slide over {window:,} tokens and are priced per token "
            f"like the others (their window alone: {window * len(sliding) * per_layer:,} bytes per request{why})")


def model_context(mc: ModelConfig, knobs: PlanKnobs) -> int:
    return mc.max_position_embeddings if knobs.max_model_len is None else min(mc.max_position_embeddings, knobs.max_model_len)


def estimate_activation_bytes(mc: ModelConfig, dtype: torch.dtype, knobs: PlanKnobs, *,
                              gathers_context: bool = True) -> int:
    """Upper estimate of one step's transient peak, in bytes, on a GPU:
    ``T = max_prefill_tokens`` new tokens, of which ``B - 1`` decode rows
    (``B = max_running_requests``) and one prefill chunk, all at the longest context
    ``S``. ``gathers_context``: the attention backend copies a chunk's context out of
    the pool (the torch backend, the default); the paged kernels (Triton, FlashInfer)
    read it in place, so the context terms below are 0. A profile run replaces the
    estimate on a real GPU; the placement of a mixture's experts is made from it first.

    Terms (``it`` = itemsize): the residual stream and its norm ``3*T*H*it``; the larger
    of the attention block and the MLP (``3*T*I*it``, or for a mixture of experts the
    larger of that, where some layers stay dense, and :func:`moe_activation_bytes`);
    the logits rows ``B*V*4``. The
    attention block holds the fused qkv ``T*(q+2kv)*it``, rotated copies
    ``T*(q+kv)*it`` and the output ``T*q*it``, plus the larger of the chunk's context
    (gathered ``2*S*kv*it``, expanded to all heads ``2*S*q*it``, its mask ``T*S`` and the
    kernel's additive bias ``T*S*it``) and a decode group's (``G = min((B-1)*S,
    gather budget)`` tokens gathered and expanded, ``2*G*(kv+q)*it``).
    """
    from engine.layers.attention.torch_backend import DEFAULT_GATHER_BUDGET_TOKENS

    it = itemsize(dtype)
    t = knobs.max_prefill_tokens
    b = max(min(knobs.max_running_requests, t), 1)
    s = model_context(mc, knobs)
    h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    residual = 3 * t * h * it
    chunk = 2 * s * (kv + q) * it + t * s * (1 + it)
    gathered = min((b - 1) * s, DEFAULT_GATHER_BUDGET_TOKENS)
    decode = 2 * gathered * (kv + q) * it
    attn = t * (q + 2 * kv) * it + t * (q + kv) * it + t * q * it + (max(chunk, decode) if gathers_context else 0)
    mlp = 3 * t * i * it if len(mc.moe_layers) < mc.num_layers else 0
    if mc.is_moe:
        mlp = max(mlp, moe_activation_bytes(mc, t, it))
    if mc.is_hybrid:
        attn = max(attn, linear_attention_activation_bytes(mc, t, it, b))
    logits = b * mc.vocab_size * 4
    return residual + max(attn, mlp) + logits


def linear_attention_activation_bytes(mc: ModelConfig, t: int, it: int, seqs: int = 1) -> int:
    """A Gated DeltaNet layer's transient peak for a prefill step of ``t`` tokens in
    ``seqs`` sequences, in bytes (:class:`engine.layers.gated_deltanet.GatedDeltaNet` on
    flash-linear-attention's ``chunk_gated_delta_rule``).

    The larger of two phases' live sets. The conv phase: the projection's flat
    ``q|k|v``, its copy after the conv state, the conv output and its SiLU
    (``4*t*C*it``, ``C = 2*Hk*Dk + Hv*Dv``) beside the output gate ``z`` and ``b``,
    ``a`` (``t*(Hv*Dv + 2*Hv)*it``). The recurrence phase, the peak for real shapes: the
    layer holds ``z``, ``b``, ``a``, ``beta`` (``t*(Hv*Dv + 3*Hv)*it``), q and k repeated
    to the value heads and a contiguous v (``t*Hv*(2*Dk + Dv)*it``) and the float32
    gate ``g`` (``t*Hv*4``); inside the kernel, q and k L2-normalized (``2*t*Hv*Dk*it``)
    with their float32 inverse norms and the gate's chunk-local cumsum (``3*t*Hv*4``),
    the intra-chunk matrix ``A`` (``t*Hv*c*it``, ``c = 64`` tokens per chunk), the WY
    factors ``w``, ``u`` (``t*Hv*(Dk + Dv)*it``), one state per chunk
    (``(ceil(t/c) + seqs - 1)*Hv*Dk*Dv*it``), the corrected values and the output
    (``2*t*Hv*Dv*it``); and per sequence the gathered initial and the final state in
    float32 (``2*seqs*Hv*Dk*Dv*4``).

    Source: the buffers the allocator saw live at the peak of one layer's forward with
    fla-core 0.6.0 on an NVIDIA H200 (``torch.cuda.memory._record_memory_history``), at
    Qwen3-Next-80B-A3B's dimensions; ``python -m engine.bench.hybrid`` compares the two.
    """
    hk, hv, dk, dv = mc.linear_num_key_heads, mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim
    c = 64
    conv_channels = 2 * hk * dk + hv * dv
    gate = t * (hv * dv + 2 * hv) * it
    conv_phase = gate + 4 * t * conv_channels * it
    held = gate + t * hv * it + t * hv * (2 * dk + dv) * it + t * hv * 4
    chunks = -(-t // c) + seqs - 1
    kernel = (2 * t * hv * dk * it + 3 * t * hv * 4 + t * hv * c * it + t * hv * (dk + dv) * it
              + chunks * hv * dk * dv * it + 2 * t * hv * dv * it + 2 * seqs * hv * dk * dv * 4)
    return max(conv_phase, held + kernel)


# Rows per block of the fused MoE kernel's sort at prefill sizes (kernels.moe.triton_kernel).
_MOE_PREFILL_BLOCK_M = 64


def moe_activation_bytes(mc: ModelConfig, t: int, it: int) -> int:
    """Upper estimate of a sparse MLP's transient peak for ``t`` tokens, in bytes, on
    the fused Triton path (:func:`kernels.moe.triton_kernel.fused_moe`): every token is
    copied once per choice, ``R = t * K`` routed rows (``K = num_experts_per_tok``).

    Terms: the router's logits and float32 softmax ``t*E*(it+4)`` and top-k weights
    and ids ``R*(4+8)``; the sort, about six int64 vectors of ``R`` and two int32 ones
    of the padded capacity ``C = R + min(E, R)*63``; the activations ``R*I*it`` and
    the weighted down products ``R*H*it`` live together, with the ``t*H*it`` output;
    a shared expert adds its gate/up and activation ``3*t*Is*it`` and its output
    ``t*H*it``. The sizes depend on ``t`` only, not on how the tokens route.
    """
    from kernels.moe.reference import padded_capacity

    k, e, h = mc.num_experts_per_tok, mc.num_experts, mc.hidden_size
    r = t * k
    router = t * e * (it + 4) + r * (4 + 8)
    sort = 6 * r * 8 + 2 * padded_capacity(r, e, _MOE_PREFILL_BLOCK_M) * 4
    routed = r * (mc.moe_intermediate_size + h) * it + t * h * it
    shared = (3 * mc.shared_expert_intermediate_size + h) * t * it if mc.shared_expert_intermediate_size else 0
    return router + sort + routed + shared


def make_footprint(
    mc: ModelConfig,
    dtype: torch.dtype,
    knobs: PlanKnobs,
    *,
    workspaces: tuple[tuple[str, int], ...] = (),
    measured_activation_bytes: int | None = None,
    measured_sampler_bytes: int | None = None,
    runtime_bytes: int = 0,
    cuda_graph_bytes: int = 0,
    weights: WeightSize | None = None,
    gathers_context: bool = True,
) -> Footprint:
    """Footprint of ``mc`` in ``dtype`` under ``knobs``.

    With ``measured_activation_bytes``, the peak is that measurement; suggestions for
    other knobs scale it by the estimate's ratio (the terms grow with the chunk alike).
    ``measured_sampler_bytes`` (for ``knobs.max_running_requests`` rows) replaces the
    per-request estimate. ``runtime_bytes`` is the CUDA context (measured with the
    activation, else estimated). ``cuda_graph_bytes`` is what capturing the decode
    step's CUDA graphs took (measured by :meth:`engine.core.cuda_graphs.DecodeGraphs.capture_all`).
    The KV cache is charged in ``knobs.kv_cache_dtype``'s storage dtype
    (:func:`engine.kvcache.pool.kv_storage_dtype`); sliding-window layers that keep only
    their window (:func:`kv_ring`) as a ring per running request, the others per token.
    ``weights`` replaces the dense size of ``mc`` in ``dtype`` with what a GGUF loaded
    with its projections in block format takes (:func:`engine.loader.gguf_quant.gguf_weight_size`),
    its routed experts priced per layer as stored (blocks, for the host tier and the
    expert cache too). ``gathers_context`` as in :func:`estimate_activation_bytes`.
    """
    kv_dtype = kv_storage_dtype(knobs.kv_cache_dtype, dtype)
    ring = kv_ring(mc, knobs)

    def ring_at(k: PlanKnobs) -> SlidingRing:
        return kv_ring(mc, k) or ring

    est_here = estimate_activation_bytes(mc, dtype, knobs, gathers_context=gathers_context)
    if measured_activation_bytes is None:
        peak, source = est_here, "estimated"

        def at(k: PlanKnobs) -> int:
            return estimate_activation_bytes(mc, dtype, k, gathers_context=gathers_context)
    else:
        peak, source = measured_activation_bytes, "measured"

        def at(k: PlanKnobs) -> int:
            if k == knobs:
                return peak
            return int(peak * estimate_activation_bytes(mc, dtype, k, gathers_context=gathers_context)
                       / max(est_here, 1))

    # The routed experts apart, for the ledger and the hybrid placement: dense shapes,
    # or a GGUF's bytes per layer as stored (blocks stay blocks in the host tier and
    # the expert cache alike).
    layer_bytes = () if weights is None else weights.expert_layer_bytes
    split = _split_prices(mc, dtype, weights, knobs)
    dense_experts = mc.is_moe and not layer_bytes and (weights is None or weights.source == "FP8")
    return Footprint(
        weight_bytes=weight_bytes(mc, dtype) if weights is None else weights.bytes,
        expert_weight_bytes=expert_weight_bytes(mc, dtype) if dense_experts else sum(layer_bytes),
        # Experts that cannot move to host memory (gpt-oss's) offer the plan no layers to move.
        expert_layers=(len(mc.moe_layers) if mc.experts_offload else 0) if dense_experts else len(layer_bytes),
        expert_layer_bytes=layer_bytes,
        expert_form="GGUF blocks" if weights is not None and weights.experts_in_blocks else "",
        num_experts=mc.num_experts,
        weight_source="exact, from tensor shapes" if weights is None else f"exact, {weights.source}: {weights.mix}",
        kv_bytes_per_token=kv_bytes_per_token(mc, kv_dtype, ring),
        kv_window_note=kv_window_note(mc, kv_dtype, ring,
                                      "" if knobs.sliding_kv_ring == "off" else kv_ring_excluded(mc, knobs)),
        kv_ring_page_bytes=kv_ring_page_bytes(mc, kv_dtype, ring) if ring is not None else 0,
        kv_ring_pages=((lambda k: (ring_at(k).rings_bound(k.max_running_requests),
                                   k.state_checkpoints * ring_at(k).checkpoint_pages, ring_at(k).decode_pages))
                       if ring is not None else None),
        kv_heads=mc.num_kv_heads,
        kv_cache_dtype=kv_dtype_name(kv_dtype),
        vocab_size=mc.vocab_size,
        model_context_tokens=model_context(mc, PlanKnobs()),
        workspace_bytes=workspaces,
        runtime_bytes=runtime_bytes,
        cuda_graph_bytes=cuda_graph_bytes,
        runtime_source="measured" if measured_activation_bytes is not None else "estimated",
        sampler_bytes_per_request=(
            SAMPLER_BYTES_PER_VOCAB_ENTRY * mc.vocab_size
            if measured_sampler_bytes is None
            else -(-measured_sampler_bytes // max(min(knobs.max_running_requests, knobs.max_prefill_tokens), 1))
        ),
        sampler_source="estimated" if measured_sampler_bytes is None else "measured",
        activation_peak_bytes=peak,
        activation_source=source,
        activation_at=at,
        state_bytes_per_request=state_bytes_per_request(mc, dtype),
        **split,
    )


def _split_prices(mc: ModelConfig, dtype: torch.dtype, weights: WeightSize | None, knobs: PlanKnobs) -> dict:
    """The :class:`Footprint` fields of ``--cpu-layers`` (none for a model that cannot
    split, or FP8 projections): each decoder layer's weights on the device and in host
    memory (a GGUF's blocks as counted per layer; dense weights in float32 on the host),
    and one layer's KV per token in the host pool (float32, or the KV dtype's blocks)."""
    from engine.core.settings_fit import splittable

    if not splittable(mc) or (weights is not None and weights.source == "FP8"):
        return {}
    if weights is None:
        device, host = layer_weight_bytes(mc, dtype), layer_weight_bytes(mc, torch.float32)
    elif weights.decoder_layer_bytes and weights.host_layer_bytes:
        device, host = weights.decoder_layer_bytes, weights.host_layer_bytes
    else:
        return {}
    kv = kv_bytes(kv_storage_dtype(knobs.kv_cache_dtype, torch.float32), 2 * mc.num_kv_heads * mc.head_dim)
    return dict(layer_bytes=tuple(device), host_layer_bytes=tuple(host), host_kv_bytes_per_token_layer=kv)
