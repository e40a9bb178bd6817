"""Sampling on the GPU: per-row parameters in persistent device tensors, Triton kernels,
no host sync until the token ids are read.

Interface for the step loop (and a CUDA graph around it):

- :class:`DeviceSampler` owns ``fparams`` (``float32 [capacity, NUM_FPARAMS]``) and
  ``iparams`` (``int64 [capacity, NUM_IPARAMS]``) on the device, laid out as
  :mod:`kernels.sampling.reference` describes. Their storage never moves unless a step has more
  rows than ``capacity`` (then both double, once; anything captured against them must be
  captured again: :attr:`DeviceSampler.generation` counts those moves).
- :meth:`DeviceSampler.load` writes a step's rows ``[0, B)`` in place: the host fills a
  pinned staging copy and one asynchronous copy per tensor moves it (no sync; the
  staging copy is reused only after the previous copy has finished, checked by an
  event). Row ``b`` takes request ``b``'s temperature (0 for greedy requests), top-p
  floor, min-p, penalties, top-k, seed and step; the step is the request's count of
  generated tokens, so a retried step draws the same tokens.
- :meth:`DeviceSampler.sample_on_device` runs the kernels on ``logits[:B]`` and returns
  ``int64 [B]`` token ids on the device (``-1`` for rows with NaN / ``+inf`` / all
  ``-inf`` logits), without syncing. Which kernels run depends on the host-side params
  (all greedy and unpenalized: an argmax; any penalty; any top-k/top-p), so a CUDA graph
  of it holds one such choice: capture per choice, or run it eagerly. The step's
  :meth:`load` (host work and the copies) belongs outside the graph, before its
  replay. :meth:`Sampler.sample <engine.sampling.sampler.Sampler.sample>` = load +
  sample_on_device + the step's one host sync.

Launches per step: two H2D copies and four Triton kernels (penalize, scale, draw over
chunks of the vocabulary, pick the winner); when every row is greedy and unpenalized,
torch's argmax and a finiteness check instead. Plus a sort and a few torch ops when a
row uses top-k or top-p, plus a ``[B, V]`` stack of the penalty counts when a
row has a penalty (penalized batches are the one place a step builds a tensor from a
Python list; the counts live with each request, see
:class:`engine.sampling.state.SamplingState`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.wire.messages import SamplingParams
from kernels.dispatch import triton_available
from kernels.sampling import reference as ref
from kernels.sampling.reference import NUM_FPARAMS, NUM_IPARAMS

_MIN_CAPACITY = 16
_SEED_MASK = (1 << 63) - 1  # int64 storage; Philox takes the 63 bits as its key


def _needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` per row (first index among ties), ``-1`` where the row's max is NaN,
    ``+inf`` or ``-inf``: the whole job when every row is greedy and unpenalized, in
    torch's own multi-block argmax (NaN counts as the max there, so a NaN row is caught).

    Returns:
        ``int64 [B]`` on ``logits.device``.
    """
    idx = logits.argmax(dim=-1)
    best = logits.gather(1, idx.unsqueeze(1)).squeeze(1)
    return torch.where(torch.isfinite(best), idx, ref.INVALID_TOKEN)


class DeviceSampler:
    """See the module docstring.

    Args:
        device: a CUDA device (the kernels are Triton's; on other devices the torch
            references run, which is what the tests use to compare).
        capacity: rows held before the first growth.
        kernels: the module with ``penalize_and_scale``, ``top_k_top_p`` and ``draw``
            (:mod:`kernels.sampling.triton_kernel` by default on CUDA, :mod:`kernels.sampling.reference`
            elsewhere and under ``--kernels torch``).

    Attributes:
        fparams, iparams: the persistent parameter tensors (``capacity`` rows).
        generation: bumped whenever ``fparams`` / ``iparams`` are reallocated.
    """

    def __init__(self, device: torch.device | str, capacity: int = 64, kernels=None) -> None:
        self.device = torch.device(device)
        if kernels is None:
            if self.device.type == "cuda" and triton_available():
                from kernels.sampling import triton_kernel as kernels
            else:
                kernels = ref
        self.kernels = kernels
        self.generation = 0
        self._event: torch.cuda.Event | None = None
        self._allocate(max(capacity, 1))

    def _allocate(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.capacity = capacity
        self.fparams = torch.zeros(capacity, NUM_FPARAMS, dtype=torch.float32, device=self.device)
        self.iparams = torch.zeros(capacity, NUM_IPARAMS, dtype=torch.int64, device=self.device)
        self._fstage = torch.zeros(capacity, NUM_FPARAMS, dtype=torch.float32, pin_memory=pin)
        self._istage = torch.zeros(capacity, NUM_IPARAMS, dtype=torch.int64, pin_memory=pin)
        self.generation += 1

    def load(self, states: Sequence, params: Sequence[SamplingParams], vocab_size: int) -> int:
        """Write rows ``[0, B)`` of the persistent parameters for this step; returns ``B``.

        Args:
            states: ``B`` :class:`~engine.sampling.state.SamplingState` (their ``seed``
                and ``num_generated`` are read).
            params: the ``B`` requests' parameters (validated already).
            vocab_size: ``V``, to clamp top-k.
        """
        B = len(params)
        if B > self.capacity:
            self._allocate(max(2 * self.capacity, B, _MIN_CAPACITY))
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the staging rows
        frows, irows = [], []
        for s, p in zip(states, params, strict=True):
            greedy = p.greedy
            # 1 - top_p in float64, rounded to float32 by numpy, as the CPU sampler's
            # Python scalar; greedy rows get no filter so their argmax is never masked.
            frows.append((
                0.0 if greedy else p.temperature,
                1.0 - p.top_p if (p.top_p < 1.0 and not greedy) else -1.0,
                0.0 if greedy else p.min_p,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            ))
            top_k = p.top_k if (0 < p.top_k < vocab_size and not greedy) else vocab_size
            irows.append((top_k, s.seed & _SEED_MASK, s.num_generated))
        if B:
            # numpy views of the (pinned) staging tensors: one C-level fill per step.
            self._fstage.numpy()[:B] = frows
            self._istage.numpy()[:B] = irows
        self.fparams[:B].copy_(self._fstage[:B], non_blocking=True)
        self.iparams[:B].copy_(self._istage[:B], non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        return B

    def sample_on_device(
        self,
        logits: torch.Tensor,
        states: Sequence,
        params: Sequence[SamplingParams],
        filtered: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Tokens for rows ``[0, B)`` of ``logits`` after :meth:`load`; no host sync.

        Args:
            logits: ``[B, V]`` float on the device.
            states, params: as given to :meth:`load` (read on the host only to choose
                which kernels run: penalties, top-k/top-p).
            filtered: optional ``float32 [B, V]`` output of the final filtered logits
                (tests).

        Returns:
            ``int64 [B]`` on the device; ``-1`` marks an unusable row.
        """
        B = logits.shape[0]
        fp, ip = self.fparams[:B], self.iparams[:B]
        penalized = any(_needs_penalty(p) for p in params)
        if filtered is None and not penalized and all(p.greedy for p in params):
            return greedy_tokens(logits)
        counts = prompt = None
        if penalized:
            V = logits.shape[1]
            zero = None
            rows, masks = [], []
            for s in states:
                if s.counts is None and zero is None:
                    zero = torch.zeros(V, dtype=torch.int32, device=logits.device)
                rows.append(s.counts if s.counts is not None else zero)
                masks.append(s.prompt_mask)
            counts = torch.stack(rows)  # [B, V] int32
            if any(m is not None for m in masks):
                none = torch.zeros(V, dtype=torch.bool, device=logits.device)
                prompt = torch.stack([m if m is not None else none for m in masks])
        x, row_max = self.kernels.penalize_and_scale(logits, fp, counts, prompt)
        V = logits.shape[1]
        if any(not p.greedy and (0 < p.top_k < V or p.top_p < 1.0) for p in params):
            x = self.kernels.top_k_top_p(x, ip, fp)
        return self.kernels.draw(x, row_max, fp, ip, filtered)
