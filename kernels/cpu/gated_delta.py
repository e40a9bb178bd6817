"""A decode step of Gated DeltaNet layers on the CPU after their input projections, in
one C call (``gated_delta.c``: the conv, the gates and the gated delta rule of every
sequence and value head), and its torch reference.

Qwen3-Next's and Qwen3.5/3.6's linear-attention layers ran a decode step as some thirty
small torch ops a layer (the conv, the splits, the L2 norms, five passes of einsum and
elementwise work over each head's state); the C call reads each head's float32 state
twice and writes it once. :func:`gdn_decode_ref` computes the same in torch, token by
token as ``engine.layers.gated_deltanet.gated_delta_rule_ref`` does, so the two agree to
float32 order.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu.threads import default_threads


def gdn_decode(lib: ctypes.CDLL, mixed: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
               a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, ssm_pool: torch.Tensor,
               slots: torch.Tensor, fresh: torch.Tensor, key_heads: int, threads: int | None = None) -> torch.Tensor:
    """One new token of each of ``B`` sequences through the layer's conv, gates and gated
    delta rule; the two pools updated in place.

    Args:
        lib: the library of :func:`kernels.cpu.build.load`.
        mixed: float32 ``[B, C]``, the input projection's q | k | v (``C = 2 Hk Dk + Hv Dv``).
        conv_pool: float32 ``[slots, C, K - 1]``, each sequence's last ``K - 1`` inputs.
        conv_weight: ``[C, 1, K]`` (or ``[C, K]``), the depthwise conv's weights.
        a, b: ``[B, Hv]``: the decay's and beta's projections.
        a_log, dt_bias: ``[Hv]``.
        ssm_pool: float32 ``[slots, Hv, Dk, Dv]``, each sequence's states.
        slots: int ``[B]``, each sequence's row of the pools.
        fresh: bool ``[B]``, True where the sequence starts at this token (states read as zeros).
        key_heads: ``Hk`` (``Hv`` a multiple of it; value head ``h`` reads key head ``h // (Hv / Hk)``).

    Returns:
        ``o`` float32 ``[B, Hv, Dv]``.

    Raises:
        ValueError: pools that are not float32 and contiguous, or shapes that do not agree.
    """
    bsz, channels = mixed.shape
    _, hv, dk, dv = ssm_pool.shape
    kernel = conv_pool.shape[-1] + 1
    if (conv_pool.dtype != torch.float32 or ssm_pool.dtype != torch.float32 or not conv_pool.is_contiguous()
            or not ssm_pool.is_contiguous() or hv % key_heads or channels != 2 * key_heads * dk + hv * dv
            or conv_pool.shape[1] != channels or tuple(a.shape) != (bsz, hv) or tuple(b.shape) != (bsz, hv)):
        raise ValueError(f"gdn_decode: mixed {tuple(mixed.shape)}, conv pool {conv_pool.dtype} {tuple(conv_pool.shape)}, "
                         f"states {ssm_pool.dtype} {tuple(ssm_pool.shape)}, a/b {tuple(a.shape)}, {key_heads} key heads")
    if bsz and (int(slots.min()) < 0 or int(slots.max()) >= min(ssm_pool.shape[0], conv_pool.shape[0])):
        raise ValueError(f"gdn_decode: a slot outside the pools' {ssm_pool.shape[0]} rows")
    args = [t.detach().float().contiguous() for t in (mixed, conv_weight.reshape(channels, kernel), a, b, a_log, dt_bias)]
    slots = slots.to(torch.int64).contiguous()
    fresh = fresh.to(torch.uint8).contiguous()
    o = torch.empty(bsz, hv, dv, dtype=torch.float32)
    work = torch.empty(bsz, channels, dtype=torch.float32)
    done = lib.hr_gdn_decode(args[0].data_ptr(), bsz, key_heads, hv, dk, dv, kernel, conv_pool.data_ptr(),
                             args[1].data_ptr(), args[2].data_ptr(), args[3].data_ptr(), args[4].data_ptr(),
                             args[5].data_ptr(), ssm_pool.data_ptr(), slots.data_ptr(), fresh.data_ptr(), o.data_ptr(),
                             work.data_ptr(), threads or default_threads())
    if done != 0:
        raise ValueError(f"gdn_decode refused a conv of {kernel} taps or {hv} value heads over {key_heads} key heads")
    return o


def gdn_decode_ref(mixed: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor, a: torch.Tensor,
                   b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, ssm_pool: torch.Tensor,
                   slots: torch.Tensor, fresh: torch.Tensor, key_heads: int) -> torch.Tensor:
    """Reference of :func:`gdn_decode` (arguments, pools updated and result as there), in
    torch: the conv by ``F.conv1d``, the rule as five passes over each state."""
    bsz, channels = mixed.shape
    _, hv, dk, dv = ssm_pool.shape
    per = hv // key_heads
    o = torch.empty(bsz, hv, dv)
    for r in range(bsz):
        slot = int(slots[r])
        history = torch.zeros_like(conv_pool[slot]) if fresh[r] else conv_pool[slot]
        seq = torch.cat([history, mixed[r].float()[:, None]], dim=-1)  # [C, K]
        conv_pool[slot] = seq[:, 1:]
        x = F.silu(F.conv1d(seq[None], conv_weight.reshape(channels, 1, -1).float(), groups=channels)[0, :, 0])
        q, k, v = x.split([key_heads * dk, key_heads * dk, hv * dv])
        q = q.view(key_heads, dk).repeat_interleave(per, 0)
        k = k.view(key_heads, dk).repeat_interleave(per, 0)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = b[r].float().sigmoid()
        decay = (-a_log.float().exp() * F.softplus(a[r].float() + dt_bias.float())).exp()
        state = torch.zeros_like(ssm_pool[slot]) if fresh[r] else ssm_pool[slot]
        state = state * decay[:, None, None]
        delta = (v.view(hv, dv) - torch.einsum("hkv,hk->hv", state, k)) * beta[:, None]
        state = state + k[:, :, None] * delta[:, None, :]
        ssm_pool[slot] = state
        o[r] = torch.einsum("hkv,hk->hv", state, q)
    return o
