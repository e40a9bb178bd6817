"""The Gated DeltaNet layer of hybrid linear-attention models (Qwen3-Next; Qwen3.5/3.6
with flat projections, :mod:`engine.models.qwen3_5`).

Per token, as ``Qwen3NextGatedDeltaNet`` in transformers computes it:

1. ``in_proj_qkvz`` -> q, k (``Hk`` heads of ``Dk``), v and the output gate z (``Hv``
   heads of ``Dv``), grouped per key head in the checkpoint; ``in_proj_ba`` -> b, a
   (``Hv`` each).
2. A short causal depthwise conv (``K`` taps, no bias) over ``[q | k | v]``, then SiLU.
   The last ``K - 1`` inputs of a sequence are its *conv state*.
3. The gated delta rule (Yang et al., "Gated Delta Networks", 2024), per value head with
   q, k L2-normalized and q scaled by ``Dk ** -0.5``; each key head serves
   ``Hv / Hk`` value heads::

       g_t = -exp(A_log) * softplus(a_t + dt_bias);   beta_t = sigmoid(b_t)
       S   = S * exp(g_t)
       S   = S + k_t (beta_t * (v_t - k_t^T S))^T     # S: [Dk, Dv], the recurrent state
       o_t = S^T q_t

4. ``o`` RMS-normalized per head (weight ``norm.weight``, not zero-centred), times
   ``silu(z)``; then ``out_proj``.

A sequence's whole past is in its two states, fixed in size: the recurrent state
``[Hv, Dk, Dv]`` (float32) and the conv state ``[conv_dim, K - 1]``. They live in the
engine's :class:`engine.kvcache.state_pool.StatePool`, at the slot the batch gives each
sequence (``ForwardBatch.state_slots``); a sequence with no prefix starts from zeros, so
a chunked prefill carries the states from chunk to chunk.

On CUDA with ``fla-core`` installed, the recurrence runs in flash-linear-attention's
Triton kernels (``chunk_gated_delta_rule`` for prefill, ``fused_recurrent_gated_delta_rule``
for decode); elsewhere :func:`gated_delta_rule_ref`, the recurrence written token by token,
for steps of up to :data:`CHUNK` tokens, and :func:`gated_delta_rule_chunked`, the same
in chunks of :data:`CHUNK` (matrix products within a chunk, the state read and written
once per chunk instead of once per token), for longer ones. A CPU decode step of a
float32 model runs steps 2 and 3 in one C call (:func:`kernels.cpu.gated_delta.gdn_decode`)
where the C kernels build. A decode step on a GPU runs on the device alone
(:meth:`GatedDeltaNet._decode`: states gathered and scattered at slots held on the
device, the batched step :func:`gated_delta_step` where fla-core is absent), so the
decode CUDA graphs hold it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.common.config import ModelConfig
from engine.common.forward_batch import ForwardBatch


@functools.cache
def _fla():
    """flash-linear-attention's two kernels, or None when ``fla-core`` is absent."""
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # eps inside the root, as flash-linear-attention's l2norm (and transformers' copy of it).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token (the torch reference:
    :func:`gated_delta_step` a token at a time).

    Args:
        q, k: ``[T, Hv, Dk]`` (already repeated to the value heads), not yet normalized.
        v: ``[T, Hv, Dv]``. g: ``[T, Hv]`` float32 log-decay. beta: ``[T, Hv]``.
        state: ``[Hv, Dk, Dv]`` float32, the recurrent state before the first token.

    Returns:
        ``(o [T, Hv, Dv] float32, state [Hv, Dk, Dv] float32 after the last token)``.
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    state = state[None]
    for t in range(q.shape[0]):
        o, state = gated_delta_step(q[t, None], k[t, None], v[t, None], g[t, None], beta[t, None], state)
        out[t] = o[0]
    return out, state[0]


def gated_delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of ``B`` sequences, each with its own state: the rule of
    :func:`gated_delta_rule_ref` batched over sequences (a decode step).

    Args:
        q, k: ``[B, Hv, Dk]``; v: ``[B, Hv, Dv]``; g, beta: ``[B, Hv]``.
        state: ``[B, Hv, Dk, Dv]`` float32.

    Returns:
        ``(o [B, Hv, Dv] float32, state [B, Hv, Dk, Dv] float32)``.
    """
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v = _l2norm(k.float()), v.float()
    state = state * g.float().exp()[:, :, None, None]
    remembered = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - remembered) * beta.float()[:, :, None]
    state = state + k[:, :, :, None] * delta[:, :, None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


# Tokens per chunk of :func:`gated_delta_rule_chunked` (flash-linear-attention's too).
CHUNK = 64


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule_ref` (same arguments and results) in chunks of
    :data:`CHUNK` tokens.

    Within a chunk starting from state ``S0``, with ``G_t`` the decay from the chunk's
    start through token ``t`` (``exp`` of the cumulative ``g``), the values the rule
    writes are ``U = (I + M)^-1 (beta V) - (I + M)^-1 (beta G K) S0``, ``M[t, j] =
    beta_t (G_t / G_j) k_t.k_j`` for ``j < t`` (one unit lower-triangular solve per
    chunk); the outputs ``O = (G q) S0 + (Q K^T * G_t / G_j, j <= t) U``, and the state
    after it ``G_C S0 + (K G_C / G)^T U``. The chunks run in order, each a few batched
    matrix products over the heads.
    """
    t, hv, dk = q.shape
    pad = -t % CHUNK
    q = _l2norm(q.float()) * dk ** -0.5
    k, v, beta, g = _l2norm(k.float()), v.float(), beta.float(), g.float()
    if pad:  # padded tokens write nothing (beta 0) and decay nothing (g 0)
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, 0, 0, pad)), F.pad(g, (0, 0, 0, pad))
    n = (t + pad) // CHUNK

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, n, C, ...]
        return x.reshape(n, CHUNK, hv, *x.shape[2:]).movedim(2, 0)

    q, k, v, beta, gc = chunks(q), chunks(k), chunks(v), chunks(beta), chunks(g).cumsum(2)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    diff = gc[..., :, None] - gc[..., None, :]  # log(G_t / G_j)
    decay = torch.where(lower, diff, float("-inf")).exp()  # [H, n, C, C], j <= t
    eye = torch.eye(CHUNK, device=q.device)
    system = eye + beta[..., None] * (k @ k.transpose(-1, -2)) * (decay * (1 - eye))  # I + M
    kb = k * (beta * gc.exp())[..., None]
    solved = torch.linalg.solve_triangular(system, torch.cat([v * beta[..., None], kb], -1),
                                           upper=False, unitriangular=True)
    u_v, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    attn = (q @ k.transpose(-1, -2)) * decay
    qg = q * gc.exp()[..., None]
    kd = k * (gc[..., -1:] - gc).exp()[..., None]  # k_j G_C / G_j
    out = torch.empty_like(v)
    for c in range(n):
        u = u_v[:, c] - w[:, c] @ state  # [H, C, Dv]
        out[:, c] = qg[:, c] @ state + attn[:, c] @ u
        state = state * gc[:, c, -1].exp()[:, None, None] + kd[:, c].transpose(-1, -2) @ u
    return out.movedim(0, 2).reshape(n * CHUNK, hv, -1)[:t], state


def gated_delta_rule_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule where flash-linear-attention does not run: token by token for up to
    :data:`CHUNK` tokens (decode, short extends), in chunks beyond."""
    rule = gated_delta_rule_chunked if q.shape[0] > CHUNK else gated_delta_rule_ref
    return rule(q, k, v, g, beta, state)


def _cpu_decode_kernels(x: torch.Tensor, batch: ForwardBatch, conv_pool: torch.Tensor):
    """The C kernels' library where this step is a CPU decode step of float32 rows and
    conv states and they build (switched on), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or conv_pool.dtype != torch.float32 or not batch.is_decode:
        return None
    from engine.layers.linear.cpu_kernels import cpu_kernels
    from kernels.switches import current

    return cpu_kernels() if current().cpu_kernels else None


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, then times ``silu(gate)`` (``Qwen3NextRMSNormGated``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; ``linear_index`` is its place among the model's
    linear layers (its row in the state pool). Parameter names follow transformers'."""

    def __init__(self, config: ModelConfig, linear_index: int) -> None:
        super().__init__()
        self.linear_index = linear_index
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(config.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(config.hidden_size, 2 * self.hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        # out_proj's input columns hold the value heads tiled (``k0v0, k1v0, k0v1, ...``,
        # llama.cpp's order, whose blocks cannot be reordered by column) instead of
        # grouped per key head: the output is tiled before it (set by the GGUF loader).
        self.out_proj_tiled = False

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, hidden]`` -> ``mixed [T, conv_dim]`` (q|k|v, flat), ``z [T, Hv, Dv]``,
        ``b``, ``a`` ``[T, Hv]``: the checkpoint groups the projections per key head."""
        t, per = x.shape[0], self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(t, self.hk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.hk, 2 * per).split([per, per], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def _conv(self, mixed: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU of one sequence: ``mixed [T, C]`` after
        ``history [C, K-1]``; returns ``(out [T, C], new history [C, K-1])``."""
        seq = torch.cat([history.to(mixed.dtype), mixed.t()], dim=-1)  # [C, K-1+T]
        out = F.conv1d(seq[None], self.conv1d.weight, groups=self.conv_dim)[0]  # [C, T]
        return F.silu(out).t(), seq[:, -(self.kernel - 1):]

    def _conv_batch(self, mixed: torch.Tensor, conv_pool: torch.Tensor, slots, lens, fresh) -> torch.Tensor:
        """:meth:`_conv` over each sequence of a ragged batch, its conv state read from and
        written back to ``conv_pool``; returns ``[T, C]``. A function of its own, so no
        local keeps a sequence's conv output alive once the caller lets it go."""
        rows, at = [], 0
        for slot, n, new in zip(slots, lens, fresh, strict=True):
            history = torch.zeros_like(conv_pool[slot]) if new else conv_pool[slot]
            out, conv_pool[slot] = self._conv(mixed[at : at + n], history)
            rows.append(out)
            at += n
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, states) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; reads and writes the step's sequences'
        states in ``states`` (an :class:`engine.kvcache.state_pool.StatePool`)."""
        mixed, z, b, a = self._split(x)
        conv_pool, ssm_pool = states.conv[self.linear_index], states.ssm[self.linear_index]
        lib = _cpu_decode_kernels(x, batch, conv_pool)
        if lib is not None:
            from kernels.cpu.gated_delta import gdn_decode

            o = gdn_decode(lib, mixed, conv_pool, self.conv1d.weight, a, b, self.A_log, self.dt_bias, ssm_pool,
                           batch.state_slots, batch.prefix_lens == 0, self.hk)
            return self._out(o, z, x)
        if batch.is_decode and x.device.type != "cpu":
            return self._out(self._decode(mixed, b, a, conv_pool, ssm_pool, batch.state_slots_on(x.device)), z, x)
        slots = batch.state_slots.tolist()
        fresh = (batch.prefix_lens == 0).tolist()
        lens = batch.extend_lens.tolist()
        q, k, v, g, beta = self._rule_inputs(self._conv_batch(mixed, conv_pool, slots, lens, fresh), b, a)
        del mixed
        if x.is_cuda and _fla() is not None:
            o = self._fla(q, k, v, g, beta, ssm_pool, slots, fresh, lens, batch.is_decode)
        else:
            outs, at = [], 0
            for slot, n, new in zip(slots, lens, fresh, strict=True):
                s = slice(at, at + n)
                state = torch.zeros_like(ssm_pool[slot]) if new else ssm_pool[slot]
                out, ssm_pool[slot] = gated_delta_rule_cpu(q[s], k[s], v[s], g[s], beta[s], state)
                outs.append(out)
                at += n
            o = torch.cat(outs)
        return self._out(o, z, x)

    def _rule_inputs(self, conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Step 3's inputs from the conv output ``[T, conv_dim]`` and ``b``, ``a``
        ``[T, Hv]``: q, k ``[T, Hv, Dk]`` (each key head repeated for its value heads), v
        ``[T, Hv, Dv]``, the float32 log-decay g and beta ``[T, Hv]``. v is a contiguous
        copy of its own, so the caller can let the conv output go before the recurrence,
        whose kernels hold the step's largest transient (they would copy v anyway)."""
        t, per = conv.shape[0], self.hv // self.hk
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.hk, self.dk).repeat_interleave(per, dim=1)
        k = k.reshape(t, self.hk, self.dk).repeat_interleave(per, dim=1)
        v = v.reshape(t, self.hv, self.dv).contiguous()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, b.sigmoid()

    def _decode(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
                ssm_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A decode step (one token a sequence) on the device alone, nothing read back, so
        a CUDA graph can hold it: each row's conv and recurrent states gathered from the
        pools at ``slots`` (int64 ``[B]`` on the device; a graph's padding rows name the
        null slot), stepped, and scattered back. Rows ``mixed [B, conv_dim]``, ``b``,
        ``a`` ``[B, Hv]``; returns the rule's ``o [B, Hv, Dv]``. A decode row always has
        a prefix (its prompt was an extend), so no state starts from zeros here."""
        seq = torch.cat([conv_pool.index_select(0, slots).to(mixed.dtype), mixed[:, :, None]], dim=-1)  # [B, C, K]
        conv_pool.index_copy_(0, slots, seq[:, :, 1:].to(conv_pool.dtype))
        conv = F.silu((seq.float() * self.conv1d.weight[:, 0, :].float()).sum(-1)).to(mixed.dtype)
        q, k, v, g, beta = self._rule_inputs(conv, b, a)
        state = ssm_pool.index_select(0, slots)
        if mixed.is_cuda and _fla() is not None:
            # [B, 1, H, D]: one token of B sequences, each from its own initial state.
            o, final = _fla()[1](q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                 scale=self.dk ** -0.5, initial_state=state, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True)
            o = o[:, 0]
        else:
            o, final = gated_delta_step(q, k, v, g, beta, state)
        ssm_pool.index_copy_(0, slots, final.to(ssm_pool.dtype))
        return o

    def _out(self, o: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Step 4: the rule's ``o [T, Hv, Dv]`` normed, gated by ``z`` and projected out."""
        t = x.shape[0]
        o = self.norm(o.to(x.dtype), z)
        if self.out_proj_tiled:
            o = o.view(t, self.hk, self.hv // self.hk, self.dv).transpose(1, 2)
        return self.out_proj(o.reshape(t, self.value_dim))

    def _fla(self, q, k, v, g, beta, ssm_pool, slots, fresh, lens, is_decode) -> torch.Tensor:
        """The recurrence in flash-linear-attention's kernels over the whole ragged batch
        (``cu_seqlens``), states gathered from and scattered back to the pool."""
        chunk, recurrent = _fla()
        index = torch.tensor(slots, device=q.device)
        initial = ssm_pool.index_select(0, index)
        if not all(not f for f in fresh):
            initial[torch.tensor(fresh, device=q.device)] = 0
        cu = torch.zeros(len(lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(lens).cumsum(0)
        kernel = recurrent if is_decode else chunk
        # By keyword: the recurrent kernel's fifth parameter is a per-key gate (gk), not beta.
        o, final = kernel(
            q[None], k[None], v[None], g=g[None], beta=beta[None],
            scale=self.dk ** -0.5, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu.to(q.device),
        )
        ssm_pool.index_copy_(0, index, final.float())
        return o[0]
