"""Paged attention in plain torch: runs anywhere and is the reference for GPU backends.

Decode rows (one new token) are batched: their context keys/values are gathered from
the pool into a padded ``[b, S, H_kv, D]`` block, in groups whose padded size stays
under ``gather_budget_tokens`` so that one long sequence next to many short ones never
blows the gather up. Prefill chunks run one sequence at a time over exactly their
context, with a causal mask offset by the cached prefix: query ``i`` sees context
positions ``j <= prefix + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend
from engine.forward_batch import ForwardBatch
from kernels.kv_store import gather_kv

# Padded decode gathers stay under this many context tokens per group.
DEFAULT_GATHER_BUDGET_TOKENS = 1 << 16


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [b] rows of T
    slots: torch.Tensor  # [b, S] context slots, padded with the null page's slot 0
    mask: torch.Tensor  # [b, 1, 1, S] bool, True where a key is real


@dataclass
class _PrefillSeq:
    start: int  # first row of T
    length: int  # new tokens
    slots: torch.Tensor  # [S] context slots
    mask: torch.Tensor | None  # [E, S] bool, None when the chunk starts the sequence (plain causal)


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """See the module docstring. Its transients scale with the step; they belong to the
    plan's measured activation peak, so ``workspace_bytes`` is 0."""

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

        def slots_of(b: int, length: int) -> torch.Tensor:
            pos = torch.arange(length, device=device)
            return batch.page_table[b, pos // ps] * ps + pos % ps

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
            mask = None
            if prefix[b] > 0:
                q_pos = prefix[b] + torch.arange(ext[b], device=device)
                mask = torch.arange(s, device=device)[None, :] <= q_pos[:, None]
            self._prefill.append(_PrefillSeq(starts[b], ext[b], slots_of(b, s), mask))

    @staticmethod
    def _decode_group(batch, group, rows, seq_lens, slots_of, device) -> _DecodeGroup:
        longest = max(seq_lens[g] for g in group)
        slots = torch.stack([slots_of(g, longest) for g in group])  # [b, S]
        # A mask even where no row is padded: the same sdpa kernel for a sequence alone
        # and in any batch, so its greedy answer does not depend on who else runs (the
        # unmasked kernel rounds differently and flipped near-ties between the two).
        lens = torch.tensor([seq_lens[g] for g in group], device=device)
        mask = (torch.arange(longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
        return _DecodeGroup(torch.tensor(rows, device=device), slots, mask)

    def _expand(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, H_kv, S, D] -> [b, H, S, D]``. With a mask, only the math kernel takes
        ``enable_gqa``; expanded heads let the memory-efficient kernel run instead of a
        materialized ``H x E x S`` score matrix."""
        groups = self.num_heads // x.shape[1]
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        out = torch.empty_like(q)  # [T, H, D]
        for g in self._decode:
            b, s = g.slots.shape
            whole = b == q.shape[0]  # the step is this one group of decode rows, in order
            qd = (q if whole else q.index_select(0, g.rows))[:, :, None, :]  # [b, H, 1, D]
            kd = gather_kv(k_buf, g.slots.reshape(-1), q.dtype).view(b, s, *k_buf.shape[1:]).transpose(1, 2)  # [b, H_kv, S, D]
            vd = gather_kv(v_buf, g.slots.reshape(-1), q.dtype).view(b, s, *v_buf.shape[1:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, self._expand(kd), self._expand(vd), attn_mask=g.mask,
                                               scale=self.scale)
            if whole:
                return o.reshape(q.shape[0], self.num_heads * self.head_dim)
            out.index_copy_(0, g.rows, o[:, :, 0, :])
        for p in self._prefill:
            qp = q[p.start : p.start + p.length].transpose(0, 1)[None]  # [1, H, E, D]
            kp = gather_kv(k_buf, p.slots, q.dtype).transpose(0, 1)[None]  # [1, H_kv, S, D]
            vp = gather_kv(v_buf, p.slots, q.dtype).transpose(0, 1)[None]
            if p.mask is None:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qp, self._expand(kp), self._expand(vp), attn_mask=p.mask, scale=self.scale)
            out[p.start : p.start + p.length] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
