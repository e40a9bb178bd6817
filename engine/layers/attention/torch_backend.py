"""Paged attention in plain torch: runs anywhere and is the reference for GPU backends.

Decode rows (one new token) are batched: their context keys/values are gathered from
the pool into a padded ``[b, H, S, D]`` block, in groups whose padded size stays
under ``gather_budget_tokens`` so that one long sequence next to many short ones never
blows the gather up. The gather reads each query head's KV head directly (one index of
pool rows per step, shared by the layers), so grouped-query attention costs one
``index_select`` per tensor instead of a gather, a transpose and a repeat: on the CPU a
batch-1 decode step spent about a fifth of its time repeating K/V heads. Prefill chunks run one sequence at a time over exactly their
context, with a causal mask offset by the cached prefix: query ``i`` sees context
positions ``j <= prefix + i``.

Sliding-window layers (:meth:`~engine.layers.attention.base.AttentionBackend.use_windows`)
gather only their window: a decode row of length ``L`` reads positions
``[max(0, L - W), L)``, a prefill chunk from ``max(0, prefix + 1 - W)``, masked so that
query ``i`` sees ``prefix + i - W < j <= prefix + i``; the pages before a window are
never read; where the sliding layers keep only their window, those gathers read the
ring's page table (:meth:`~engine.common.forward_batch.ForwardBatch.page_table_for`).
Soft-capped scores (``softcap``) go through the plain matmul-softmax path
(sdpa has no cap), capped before the mask as transformers' eager attention does; so do
attention sinks (``sinks``: gpt-oss's logit per head, a last column of the softmax
dropped before the values, as its eager attention computes it).

A pool of llama.cpp's blocks (``--kv-cache-dtype q8_0``/``q4_0``) is read through the
same gathers: each gathered row is dequantized on its way out
(:func:`kernels.attention.kv_store.gather_kv`), so a step turns into floats only the
rows it attends over, never a page it does not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.common.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionBackend
from kernels.attention.kv_store import gather_kv

# Padded decode gathers stay under this many context tokens per group.
DEFAULT_GATHER_BUDGET_TOKENS = 1 << 16


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [b] rows of T
    heads: torch.Tensor  # [b * H * S] rows of the pool seen as [slots * H_kv, D], padded with slot 0's
    mask: torch.Tensor  # [b, 1, 1, S] bool, True where a key is real
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # window -> (heads, mask)


@dataclass
class _PrefillSeq:
    start: int  # first row of T
    length: int  # new tokens
    slots: torch.Tensor  # [S] context slots
    mask: torch.Tensor | None  # [E, S] bool, None when the chunk starts the sequence (plain causal)
    heads: torch.Tensor | None  # [H * S] pool rows per query head (with mask), as _DecodeGroup's
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # window -> (heads, mask)


class TorchAttentionBackend(AttentionBackend):
    """See the module docstring. Its transients scale with the step; they belong to the
    plan's measured activation peak, so ``workspace_bytes`` is 0."""

    gathers_context = True
    supports_windows = True
    supports_softcap = True
    supports_sinks = True
    kv_block_formats = ("q8_0", "q4_0")

    workspace_bytes = 0

    def __init__(self, pool, *, num_heads: int, head_dim: int, scale: float, max_batch: int = 64,
                 gather_budget_tokens: int = DEFAULT_GATHER_BUDGET_TOKENS) -> None:
        super().__init__(pool, num_heads=num_heads, head_dim=head_dim, scale=scale, max_batch=max_batch)
        self.gather_budget_tokens = gather_budget_tokens

    def prepare(self, batch: ForwardBatch) -> None:
        ps = self.pool.page_size
        device = batch.page_table.device
        ext = batch.extend_lens.tolist()
        seq_lens = batch.seq_lens.tolist()
        prefix = batch.prefix_lens.tolist()
        starts = [0]
        for e in ext[:-1]:
            starts.append(starts[-1] + e)

        # The windowed gathers read the sliding layers' ring when they keep only their
        # window (every windowed layer is then a ring layer, engine.kvcache.ring).
        window_table = batch.page_table_for(bool(self.pool.ring_layers))

        def slots_at(b, pos: torch.Tensor, table: torch.Tensor = batch.page_table) -> torch.Tensor:
            """Pool slots of positions ``pos`` of row(s) ``b`` (an int, or ``[b, 1]`` rows)."""
            return table[b, pos // ps] * ps + pos % ps

        def slots_of(b: int, length: int) -> torch.Tensor:
            return slots_at(b, torch.arange(length, device=device))

        self._window_slots_at = lambda b, pos: slots_at(b, pos, window_table)
        self._decode: list[_DecodeGroup] = []
        self._prefill: list[_PrefillSeq] = []
        decode_rows = [b for b in range(len(ext)) if ext[b] == 1]
        # Group decode rows so that rows x longest context stays under the budget.
        group: list[int] = []
        for b in decode_rows + [None]:
            longest = max([seq_lens[g] for g in group] + ([seq_lens[b]] if b is not None else [0]))
            if group and (b is None or (len(group) + 1) * longest > self.gather_budget_tokens):
                self._decode.append(self._decode_group(batch, group, [starts[g] for g in group], seq_lens, slots_of, device))
                group = []
            if b is not None:
                group.append(b)
        for b in range(len(ext)):
            if ext[b] == 1:
                continue
            s = seq_lens[b]
            mask = heads = None
            slots = slots_of(b, s)
            q_pos = prefix[b] + torch.arange(ext[b], device=device)
            if prefix[b] > 0 or self.softcap:
                mask = torch.arange(s, device=device)[None, :] <= q_pos[:, None]
                heads = self._head_rows(slots)
            seq = _PrefillSeq(starts[b], ext[b], slots, mask, heads)
            for w in set(self.windows) - {0}:
                lo = max(0, prefix[b] + 1 - w)
                k_pos = torch.arange(lo, s, device=device)
                d = q_pos[:, None] - k_pos[None, :]  # [E, S - lo]
                seq.windowed[w] = (self._head_rows(slots_at(b, k_pos, window_table)), (d >= 0) & (d < w))
            self._prefill.append(seq)

    def _head_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's pool seen as ``[slots * H_kv, D]`` for ``slots [..., S]``, in
        ``[..., H, S]`` order flattened: query head ``h`` reads KV head ``h // (H / H_kv)``."""
        kv_heads = self.pool.num_kv_heads
        head = torch.arange(self.num_heads, device=slots.device) // (self.num_heads // kv_heads)
        return (slots.unsqueeze(-2) * kv_heads + head[:, None]).reshape(-1)

    def _gather_heads(self, buf: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, *shape: int) -> torch.Tensor:
        """``[*shape, H, S, D]`` keys or values of ``buf [slots, H_kv, W]`` at ``rows``
        (:meth:`_head_rows`), contiguous, in ``dtype``; a block pool's rows are
        dequantized as they are read, and only those."""
        return gather_kv(buf.view(-1, buf.shape[-1]), rows, dtype).view(*shape, self.num_heads, -1, self.head_dim)

    def _decode_group(self, batch, group, rows, seq_lens, slots_of, device) -> _DecodeGroup:
        longest = max(seq_lens[g] for g in group)
        slots = torch.stack([slots_of(g, longest) for g in group])  # [b, S]
        # A mask even where no row is padded: the same sdpa kernel for a sequence alone
        # and in any batch, so its greedy answer does not depend on who else runs (the
        # unmasked kernel rounds differently and flipped near-ties between the two).
        lens = torch.tensor([seq_lens[g] for g in group], device=device)
        mask = (torch.arange(longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
        out = _DecodeGroup(torch.tensor(rows, device=device), self._head_rows(slots), mask)
        for w in set(self.windows) - {0}:
            # Each row's last min(w, longest) positions from max(0, L - w): within its
            # length but for a row shorter than the window (masked).
            pos = (lens - w).clamp(min=0)[:, None] + torch.arange(min(w, longest), device=device)[None, :]
            idx = torch.tensor(group, device=device)[:, None]
            out.windowed[w] = (self._head_rows(self._window_slots_at(idx, pos)), (pos < lens[:, None])[:, None, None, :])
        return out

    def _sdpa(self, q, k, v, mask, sinks=None, **kwargs) -> torch.Tensor:
        """sdpa of ``[.., H, E, D]`` queries; with ``softcap`` or ``sinks`` (``[H]``), the
        matmul-softmax path that caps the scores before ``mask`` (None: causal, keys of
        ``q``'s heads or of fewer that each serve a group of them) and puts each head's
        sink in the softmax's denominator."""
        if not self.softcap and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, **kwargs)
        if k.shape[-3] != q.shape[-3]:  # grouped-query keys and values, each serving q.shape[-3] / k.shape[-3] heads
            k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
        sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(q.dtype), v)

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AttentionBackend.attend`, with ``sinks`` (``[H]`` logits, or None) as
        :meth:`AttentionBackend.forward` takes them."""
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        window = self.windows[layer] if self.windows else 0
        out = torch.empty_like(q)  # [T, H, D]
        for g in self._decode:
            b = g.rows.shape[0]
            whole = b == q.shape[0]  # the step is this one group of decode rows, in order
            qd = (q if whole else q.index_select(0, g.rows))[:, :, None, :]  # [b, H, 1, D]
            heads, mask = g.windowed[window] if window else (g.heads, g.mask)
            # Query heads' keys and values gathered as such: with a mask only sdpa's math
            # kernel takes ``enable_gqa`` (an H x E x S score matrix); whole heads keep the
            # fused kernel.
            kd = self._gather_heads(k_buf, heads, q.dtype, b)  # [b, H, S, D]
            vd = self._gather_heads(v_buf, heads, q.dtype, b)
            o = self._sdpa(qd, kd, vd, mask, sinks)
            if whole:
                return o.reshape(q.shape[0], self.num_heads * self.head_dim)
            out.index_copy_(0, g.rows, o[:, :, 0, :])
        for p in self._prefill:
            qp = q[p.start : p.start + p.length].transpose(0, 1)[None]  # [1, H, E, D]
            heads, mask = p.windowed[window] if window else (p.heads, p.mask)
            if mask is None:
                kp = gather_kv(k_buf, p.slots, q.dtype).transpose(0, 1)[None]  # [1, H_kv, S, D]
                vp = gather_kv(v_buf, p.slots, q.dtype).transpose(0, 1)[None]
                o = self._sdpa(qp, kp, vp, None, sinks, is_causal=True, enable_gqa=True)
            else:
                kp = self._gather_heads(k_buf, heads, q.dtype, 1)  # [1, H, S, D]
                vp = self._gather_heads(v_buf, heads, q.dtype, 1)
                o = self._sdpa(qp, kp, vp, mask, sinks)
            out[p.start : p.start + p.length] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
