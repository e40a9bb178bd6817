"""Log-probabilities of chosen tokens and their top-k alternatives.

Used for OpenAI's ``logprobs``/``top_logprobs`` (generated tokens) and ``echo`` with
``logprobs`` (prompt tokens). Only rows that ask pay for it: one log-softmax over their
rows, one gather, one top-k, and one device-to-host copy of ``[R, 1 + 2k]`` numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.wire.messages import TokenLogprobs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """Each row's log-softmax at its token, and its ``k`` largest entries.

    Args:
        logits: ``[R, V]`` float (upcast to float32), any device.
        tokens: ``[R]`` int token ids, any device.
        ks: ``R`` counts of alternatives (each in ``0..V``).

    Returns:
        ``R`` records, alternatives most likely first (ties: lower id first is not
        promised; torch's top-k order).
    """
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    idx = tokens.to(device=lp.device, dtype=torch.long).unsqueeze(1)  # [R, 1]
    chosen = lp.gather(1, idx).squeeze(1)  # [R]
    k = max(ks)
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)  # [R, k] each, descending
        packed = torch.cat([chosen.unsqueeze(1), top_lp], dim=1).cpu()
        top_ids = top_ids.cpu()
    else:
        packed = chosen.unsqueeze(1).cpu()
        top_ids = torch.empty(len(ks), 0, dtype=torch.long)
    ids = idx.squeeze(1).cpu().tolist()
    rows = packed.tolist()
    return [
        TokenLogprobs(
            token_id=ids[r],
            logprob=rows[r][0],
            top_ids=top_ids[r, :kr].tolist(),
            top_logprobs=rows[r][1 : 1 + kr],
        )
        for r, kr in enumerate(ks)
    ]
