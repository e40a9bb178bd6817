"""Paged attention in plain torch: runs anywhere and is the reference for GPU backends.

Each step gathers every sequence's context keys/values from the pool into a padded
``[B, S_max, H_kv, D]`` block and runs one masked ``scaled_dot_product_attention``.
The mask row of new token ``i`` of sequence ``b`` allows context positions
``j <= prefix_len[b] + i`` and ``j < seq_len[b]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend
from engine.forward_batch import ForwardBatch


@register_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    workspace_bytes = 0  # everything it allocates scales with the step (the plan's activation peak)

    def prepare(self, batch: ForwardBatch) -> None:
        page_size = self.pool.page_size
        device = batch.page_table.device
        seq_lens = batch.seq_lens
        max_seq = int(seq_lens.max())
        max_ext = int(batch.extend_lens.max())
        # Context slots of each sequence: [B, S_max], padded with slot 0 (null page).
        pos = torch.arange(max_seq, device=device)
        pages = batch.page_table[:, (pos // page_size)]
        self._ctx_slots = pages * page_size + pos % page_size
        seq_lens_d = seq_lens.to(device)
        prefix_d = batch.prefix_lens.to(device)
        ext_d = batch.extend_lens.to(device)
        # Where each new token sits in the padded [B, E_max] query block.
        self._q_rows = torch.repeat_interleave(torch.arange(batch.batch_size, device=device), ext_d)
        starts = torch.cumsum(ext_d, 0) - ext_d
        self._q_cols = torch.arange(batch.num_tokens, device=device) - torch.repeat_interleave(starts, ext_d)
        q_pos = prefix_d[:, None] + torch.arange(max_ext, device=device)[None, :]  # [B, E_max]
        mask = (pos[None, None, :] <= q_pos[:, :, None]) & (pos[None, None, :] < seq_lens_d[:, None, None])
        self._mask = mask[:, None, :, :]  # [B, 1, E_max, S_max]
        self._max_ext = max_ext

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.store(layer, batch.out_slots, k, v)
        bsz, max_ext = batch.batch_size, self._max_ext
        q_pad = q.new_zeros(bsz, max_ext, self.num_heads, self.head_dim)
        q_pad[self._q_rows, self._q_cols] = q
        k_ctx = self.pool.k_buffers[layer][self._ctx_slots]  # [B, S_max, H_kv, D]
        v_ctx = self.pool.v_buffers[layer][self._ctx_slots]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            k_ctx.transpose(1, 2),
            v_ctx.transpose(1, 2),
            attn_mask=self._mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, H, E_max, D]
        out = out.transpose(1, 2)[self._q_rows, self._q_cols]  # [T, H, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
