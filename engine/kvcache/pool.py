"""The paged KV cache pool: one key and one value buffer per layer.

Layout per layer: ``[num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_pages * page_size``; a token's K/V live at slot
``page * page_size + offset``. Keeping one buffer per layer (not one tensor for all
layers) lets a later resize proceed layer by layer without ever holding two whole pools.

Page 0 is the null page: it is never handed out, so padded page tables (0) and padded
slots point at harmless memory.
"""

from __future__ import annotations

import torch


class KVPool:
    """Key/value buffers for ``num_layers`` layers.

    Args:
        num_layers: decoder layers.
        num_pages: pages in the pool, the null page included (so ``num_pages - 1`` are
            usable). Must be at least 2.
        page_size: tokens per page.
        num_kv_heads, head_dim: per-token K/V shape.
        dtype, device: of the buffers.

    Raises:
        ValueError: ``num_pages < 2`` or ``page_size < 1``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs over all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def num_pages(self) -> int:
        """Pages in the pool now, the null page included. A runtime property: resizes change it."""
        return self.k_buffers[0].shape[0] // self.page_size

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.k_buffers) + sum(b.nbytes for b in self.v_buffers)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' keys and values.

        Args:
            slots: ``[T]`` int64 flat slots.
            k, v: ``[T, num_kv_heads, head_dim]`` in the pool's dtype.
        """
        # index_copy_ is a plain scatter; advanced-index assignment goes through the
        # slower index_put_ machinery.
        self.k_buffers[layer].index_copy_(0, slots, k)
        self.v_buffers[layer].index_copy_(0, slots, v)
