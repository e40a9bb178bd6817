"""The description of one model step over a ragged batch of sequences.

All token-level tensors are flattened over the batch: sequence ``b`` owns the rows
``cu_extend[b]:cu_extend[b+1]`` of ``input_ids``, ``positions`` and ``out_slots``.
A prefill (extend) step and a decode step use the same record; a decode step simply
has ``extend_lens == 1`` everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Inputs of one forward pass.

    Attributes:
        is_decode: every sequence extends by exactly one token.
        input_ids: ``[T]`` int64, the new tokens of all sequences, concatenated.
        positions: ``[T]`` int64, absolute position of each new token.
        out_slots: ``[T]`` int64, flat KV slot (``page * page_size + offset``) that
            receives each new token's key and value.
        page_table: ``[B, max_pages]`` int64, the pages of each sequence in order,
            padded with 0 (page 0 is the pool's never-allocated null page).
        prefix_lens: ``[B]`` int64 on the CPU, tokens already in the KV cache before
            this step.
        extend_lens: ``[B]`` int64 on the CPU, new tokens this step (``sum == T``).
        logits_indices: ``[L]`` int64, the rows in ``T`` the model returns logits for:
            each sampling sequence's last new token, and every token of a scored chunk
            (a prompt whose logprobs are wanted, ``StepItem.scores``).
        sample_rows: None when no chunk is scored (the logits rows are the sampling
            rows); else ``[S]`` int64 on the CPU, the logits row of each sampling
            sequence.
        seq_lens_device, prefix_lens_device, extend_lens_device, extend_starts_device:
            ``[B]`` int64 on the model's device (kernels read them there): KV length after
            the step, cached prefix, new tokens, and the first row in ``T`` of each
            sequence. The runner fills them from its persistent buffers; when left None,
            :meth:`device_meta` builds them from the CPU copies.
        page_table_cpu: the page table on the CPU when the runner has it at hand (for
            backends that plan on the host), else None.
        state_slots: ``[B]`` int64 on the CPU, each sequence's slot in the state pool of
            a hybrid linear-attention model; None for other models.
        state_slots_device: the same on the model's device where the decode CUDA graphs
            hold it (their padding rows name the null slot 0); read through
            :meth:`state_slots_on`.
        ring_page_table, ring_out_slots: the sliding-window layers' page table
            (``[B, max_pages]`` int64, each logical page's ring page) and write slots
            (``[T]`` int64) when those layers keep only their window
            (:mod:`engine.kvcache.ring`); None otherwise. Read them through
            :meth:`page_table_for` and :meth:`out_slots_for`.
    """

    is_decode: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    logits_indices: torch.Tensor
    seq_lens_device: torch.Tensor | None = None
    prefix_lens_device: torch.Tensor | None = None
    extend_lens_device: torch.Tensor | None = None
    extend_starts_device: torch.Tensor | None = None
    page_table_cpu: torch.Tensor | None = None
    sample_rows: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    state_slots_device: torch.Tensor | None = None
    ring_page_table: torch.Tensor | None = None
    ring_out_slots: torch.Tensor | None = None

    def page_table_for(self, ring: bool) -> torch.Tensor:
        """The page table a layer reads: the ring's for a ring layer (``ring``), else
        :attr:`page_table`.

        Raises:
            ValueError: a ring layer, but the batch carries no ring page table (it was
                built without the requests' rings).
        """
        if not ring:
            return self.page_table
        if self.ring_page_table is None:
            raise ValueError("a sliding-window layer keeps only its window, but this batch has no ring page table; "
                             "build it from the scheduler's requests (engine.core.step_inputs)")
        return self.ring_page_table

    def out_slots_for(self, ring: bool) -> torch.Tensor:
        """The slots a layer writes the step's keys and values to: the ring's for a ring
        layer (``ring``), else :attr:`out_slots`.

        Raises:
            ValueError: as :meth:`page_table_for`.
        """
        if not ring:
            return self.out_slots
        self.page_table_for(True)
        return self.ring_out_slots

    def device_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(seq_lens, prefix_lens, extend_lens, extend_starts)`` on the model's device,
        ``[B]`` int64 each; built once from the CPU copies if the runner left them unset
        (tests, the profile run). Under CUDA-graph capture they are always set, so this
        issues no copy there."""
        if self.seq_lens_device is None:
            device = self.input_ids.device
            starts = torch.cumsum(self.extend_lens, 0) - self.extend_lens
            packed = torch.stack([self.seq_lens, self.prefix_lens, self.extend_lens, starts]).to(device)
            self.seq_lens_device, self.prefix_lens_device, self.extend_lens_device, self.extend_starts_device = packed
        return self.seq_lens_device, self.prefix_lens_device, self.extend_lens_device, self.extend_starts_device

    def state_slots_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`state_slots` on ``device``, copied once if the runner left
        :attr:`state_slots_device` unset (eager steps; a captured graph has it set).

        Raises:
            ValueError: the batch has no state slots (not a hybrid model's).
        """
        if self.state_slots_device is None:
            if self.state_slots is None:
                raise ValueError("a linear-attention layer steps with the batch's state slots; this batch has none")
            self.state_slots_device = self.state_slots.to(device)
        return self.state_slots_device

    @property
    def batch_size(self) -> int:
        return int(self.extend_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[B]`` int64 on the CPU: KV length of each sequence after this step."""
        return self.prefix_lens + self.extend_lens
