"""Pick the next token of each request from its logits.

One engine step gives ``logits[B, V]``; :class:`Sampler` turns them into ``tokens[B]``.
Each request keeps a :class:`~engine.sampling.state.SamplingState`: its own random
generator (so its tokens do not depend on what else is in the batch) and the counts of
its generated tokens (for the penalties).

Order, per row: logit bias, grammar mask (structured output), a forced token (a
thinking block closed at its budget, :mod:`engine.sampling.thinking`), repetition penalty, presence/frequency penalties, then greedy rows take
the argmax; sampled rows go through temperature, top-k, top-p, min-p (the order of
transformers' ``generate``) and draw with their own generator.

Batch invariance: every batched op here works row by row (sort, softmax, cumsum,
argmax along the vocab), and each sampled row draws exactly ``V`` exponentials from its
own generator, so a row's token is the same alone or in a batch of any composition.

On CUDA with Triton installed, :meth:`Sampler.sample` runs
:class:`engine.sampling.device.DeviceSampler` instead: the same semantics, per-row
parameters in persistent device tensors, one host sync per step (reading the token ids).
Its random draws come from a counter-based generator keyed on ``(seed, number of tokens
generated)`` rather than from the request's ``torch.Generator``, so seeded requests are
reproducible on each device but give different tokens on the CPU and on the GPU; greedy
requests give the same tokens on both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.grammar import apply_grammars
from engine.sampling.logprobs import token_logprobs
from engine.sampling.state import (
    SamplingState,
    all_plain_greedy,
    has_openai_penalty,
    has_repetition_penalty,
)
from engine.sampling.thinking import apply_forced, forced_tokens
from engine.wire.messages import SamplingParams, TokenLogprobs
from kernels.dispatch import use_triton
from kernels.sampling.reference import INVALID_TOKEN

# What a request whose logits cannot be sampled from is told (error_code invalid_logits).
INVALID_LOGITS_MESSAGE = (
    "the model produced NaN or infinite logits for this request, so no token could be chosen: "
    "the model file may be corrupt (download or convert it again), or its values overflow in "
    "this dtype (try another --dtype or quantization)"
)


class InvalidLogitsError(ValueError):
    """Some rows' logits cannot be sampled from: NaN, ``+inf``, or every token ``-inf``.

    ``rows`` are the batch indices at fault. Nothing was drawn from any generator, so the
    caller can fail those requests (e.g. ``error_code="invalid_logits"``, with
    :data:`INVALID_LOGITS_MESSAGE`) and call :meth:`Sampler.sample` again with the other rows.
    """

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"logits of batch rows {rows} are NaN, +inf, or all -inf (after penalties)")
        self.rows = rows


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` plus each row's ``logit_bias`` (OpenAI's: added to the raw logits,
    before penalties and filters); ``logits`` itself when no row has one, else a new
    float32 tensor (one host-to-device copy of the pairs).

    Args:
        logits: ``[B, V]`` float.
        params: ``B`` parameter sets; their token ids are checked against ``V`` when
            their state is built.
    """
    rows, ids, biases = [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(row)
            ids.append(token)
            biases.append(bias)
    if not rows:
        return logits
    x = logits.float().clone()
    index = torch.tensor([rows, ids], dtype=torch.long).to(x.device)  # [2, N]
    values = torch.tensor(biases, dtype=x.dtype).to(x.device)  # [N]
    return x.index_put_((index[0], index[1]), values, accumulate=True)


class Sampler:
    """Turns a batch of logits into one token per row.

    Stateless: everything per request lives in :class:`SamplingState`, so one sampler
    serves the whole engine. ``check_logits`` (default on) costs one device sync per
    step to turn NaN/inf logits into :class:`InvalidLogitsError` instead of garbage
    tokens.
    """

    def __init__(self, check_logits: bool = True) -> None:
        self.check_logits = check_logits
        self._device_sampler = None  # DeviceSampler, made on the first CUDA batch

    def device_sampler(self, device: torch.device):
        """The :class:`~engine.sampling.device.DeviceSampler` used for CUDA logits on
        ``device`` (made on first use; its persistent tensors live there)."""
        if self._device_sampler is None or self._device_sampler.device != device:
            from engine.sampling.device import DeviceSampler

            self._device_sampler = DeviceSampler(device)
        return self._device_sampler

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        params: Sequence[SamplingParams],
        logprobs: list[TokenLogprobs | None] | None = None,
    ) -> torch.Tensor:
        """Pick one token per row.

        Args:
            logits: ``[B, V]`` float (float32 expected; other float dtypes are upcast),
                on the states' device. Not modified.
            states: ``B`` states, row ``i`` belongs to ``states[i]``. Sampled rows
                advance their generator; greedy rows never touch it. Counts are not
                updated: call :meth:`SamplingState.append` with the chosen tokens.
            params: ``B`` parameter sets, each the one its state was built with.
            logprobs: a list to fill, when given, with one entry per row: the chosen
                token's :class:`TokenLogprobs` for rows whose ``params.logprobs`` is
                set (computed from the logits after ``logit_bias`` and the grammar
                mask, before penalties, temperature and filters), None for the others.

        Returns:
            ``int64 [B]`` token ids on ``logits.device``; on the GPU path (CUDA logits,
            Triton installed) on the CPU instead, already read back: that read is the
            step's one host sync.

        Raises:
            ValueError: shape mismatch between ``logits``, ``states`` and ``params``, or a
                state built for different params, another vocab size or another device.
            InvalidLogitsError: some rows are NaN/+inf/all -inf (``check_logits`` only on
                the CPU path; always on the GPU path, where the check is free); no
                generator has advanced then.
        """
        self._check_batch(logits, states, params)
        logits = apply_logit_bias(logits, params)
        logits = apply_grammars(logits, [s.matcher for s in states])
        logits = apply_forced(logits, forced_tokens([s.thinking for s in states]))
        tokens = self._sample(logits, states, params)
        if logprobs is not None:
            logprobs[:] = [None] * len(params)
            rows = [i for i, p in enumerate(params) if p.logprobs is not None]
            if rows:
                idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
                found = token_logprobs(
                    logits.index_select(0, idx), tokens[rows], [params[i].logprobs for i in rows]
                )
                for i, record in zip(rows, found, strict=True):
                    logprobs[i] = record
        return tokens

    def _sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:
        if use_triton(logits):
            sampler = self.device_sampler(logits.device)
            if not all_plain_greedy(params):
                # Greedy, unpenalized rows read no per-row parameter: no upload needed.
                sampler.load(states, params, logits.shape[1])
            return self.read_tokens(sampler.sample_on_device(logits, states, params))
        x = self.penalize(logits, states, params)  # [B, V] float32
        if self.check_logits:
            bad = ~torch.isfinite(x.amax(dim=-1))  # NaN propagates through amax
            if bool(bad.any()):
                raise InvalidLogitsError(bad.nonzero().flatten().tolist())

        rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(rows) < len(params):
            tokens = x.argmax(dim=-1)  # [B] int64; right for the greedy rows
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=x.device)  # [B]
        if not rows:
            return tokens
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)  # [S]
        sub = x if len(rows) == len(params) else x.index_select(0, idx)  # [S, V]
        probs = torch.softmax(self.filter(sub, [params[i] for i in rows]), dim=-1)  # [S, V]
        # Exponential race (Gumbel-max in another guise): argmax(p / E), E ~ Exp(1) iid,
        # picks token j with probability p_j. Each row draws its V exponentials from its
        # own generator, so the draw does not depend on the other rows.
        race = torch.empty_like(probs)  # [S, V]
        for j, i in enumerate(rows):
            race[j].exponential_(generator=states[i].generator)
        race.clamp_min_(torch.finfo(race.dtype).tiny)  # an exact 0 would make 0/0 = NaN
        tokens[idx] = (probs / race).argmax(dim=-1)
        return tokens

    @staticmethod
    def read_tokens(tokens: torch.Tensor) -> torch.Tensor:
        """Read ``int64 [B]`` device token ids back to the host (the step's one sync) and
        check them: ``-1`` marks a row whose logits were unusable.

        Raises:
            InvalidLogitsError: naming those rows.
        """
        tokens = tokens.cpu()
        bad = tokens == INVALID_TOKEN
        if bool(bad.any()):
            raise InvalidLogitsError(bad.nonzero().flatten().tolist())
        return tokens

    @staticmethod
    def penalize(
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:
        """Apply repetition, then presence/frequency penalties; returns a new tensor.

        Repetition penalty (CTRL, Keskar et al. 2019, as transformers'
        ``RepetitionPenaltyLogitsProcessor``): for every token seen in the prompt or the
        generated text, once per token, a positive logit is divided by the penalty and a
        negative one multiplied by it.

        Presence/frequency penalties (OpenAI, "Parameter details" in the text
        generation guide): ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``
        where ``count`` counts *generated* tokens only.

        Args:
            logits: ``[B, V]`` float; upcast to float32.
            states, params: as in :meth:`sample`.

        Returns:
            ``float32 [B, V]``; ``logits`` itself (upcast) when no row has a penalty.
        """
        x = logits.float()
        rep = [i for i, p in enumerate(params) if has_repetition_penalty(p)]
        if rep:
            idx = torch.tensor(rep, dtype=torch.long, device=x.device)
            sub = x.index_select(0, idx)  # [R, V]
            counts = torch.stack([states[i].counts for i in rep])  # [R, V] int32
            seen = torch.stack([states[i].prompt_mask for i in rep]) | (counts > 0)
            penalty = torch.tensor(
                [params[i].repetition_penalty for i in rep], dtype=x.dtype, device=x.device
            ).unsqueeze(1)  # [R, 1]
            penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
            x = x.index_copy(0, idx, torch.where(seen, penalized, sub))
        oai = [i for i, p in enumerate(params) if has_openai_penalty(p)]
        if oai:
            idx = torch.tensor(oai, dtype=torch.long, device=x.device)
            counts = torch.stack([states[i].counts for i in oai]).to(x.dtype)  # [F, V]
            pf = torch.tensor(
                [[params[i].presence_penalty, params[i].frequency_penalty] for i in oai],
                dtype=x.dtype,
                device=x.device,
            )  # [F, 2]
            delta = counts * pf[:, 1:2] + (counts > 0).to(x.dtype) * pf[:, 0:1]
            x = x.index_copy(0, idx, x.index_select(0, idx) - delta)
        return x

    @staticmethod
    def filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Temperature, then top-k, top-p, min-p, as transformers' warpers do.

        Removed tokens get ``-inf``. Rows are shifted by their max before dividing by the
        temperature, so a tiny temperature gives ``0`` for the best token and ``-inf``
        (never NaN) elsewhere; the result equals transformers' scores up to a per-row
        constant, i.e. the same softmax. Top-k keeps ties with the k-th value; top-p
        keeps the smallest set whose mass reaches ``top_p`` and always the best token;
        min-p keeps tokens with ``p >= min_p * p_max``.

        Args:
            logits: ``float32 [S, V]``, every row with a finite max (greedy rows have
                been taken out; ``temperature > 0`` for all rows).
            params: ``S`` parameter sets.

        Returns:
            ``float32 [S, V]`` filtered logits (a new tensor).
        """
        S, V = logits.shape
        dev, dt = logits.device, logits.dtype
        x = logits - logits.amax(dim=-1, keepdim=True)  # [S, V], row max 0
        if any(p.temperature != 1.0 for p in params):  # x / 1.0 == x exactly: skip
            temp = torch.tensor([p.temperature for p in params], dtype=dt, device=dev)  # [S]
            x = x / temp.unsqueeze(1)

        top_k = [min(p.top_k, V) if p.top_k > 0 else V for p in params]
        use_k = any(k < V for k in top_k)
        use_p = any(p.top_p < 1.0 for p in params)
        if use_k or use_p:
            # Ascending like transformers' top-p, stable so ties order the same way in
            # every batch.
            xs, order = torch.sort(x, dim=-1, stable=True)  # [S, V] each
            if use_k:
                k = torch.tensor(top_k, dtype=torch.long, device=dev)  # [S]
                kth = xs.gather(1, (V - k).unsqueeze(1))  # [S, 1]
                xs = xs.masked_fill(xs < kth, float("-inf"))
            if use_p:
                cum = torch.softmax(xs, dim=-1).cumsum(dim=-1)  # [S, V]
                # 1 - top_p in float64 then float32, as a Python scalar would be; -1 for
                # rows without top-p, so they lose nothing (not even p == 0 tokens).
                floor = torch.tensor(
                    [1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params],
                    dtype=dt,
                    device=dev,
                )  # [S]
                drop = cum <= floor.unsqueeze(1)
                drop[:, -1] = False  # the best token always stays
                xs = xs.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, xs)

        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=dt, device=dev)  # [S]
            probs = torch.softmax(x, dim=-1)  # [S, V]
            floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
            x = x.masked_fill(probs < floor, float("-inf"))
        return x

    @staticmethod
    def _check_batch(
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        params: Sequence[SamplingParams],
    ) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(states) != B or len(params) != B:
            raise ValueError(f"{B} logit rows but {len(states)} states and {len(params)} params")
        for i, (s, p) in enumerate(zip(states, params, strict=True)):
            if s.vocab_size != V:
                raise ValueError(f"row {i}: state built for vocab {s.vocab_size}, logits have {V}")
            if s.device.type != logits.device.type or s.device.index not in (
                None,
                logits.device.index,
            ):
                raise ValueError(f"row {i}: state lives on {s.device}, logits on {logits.device}")
            if s.params is not p and s.params != p:
                raise ValueError(
                    f"row {i}: params differ from those its SamplingState was built with; "
                    "build a new state when a request's sampling params change"
                )
