"""A step's results as the requests' outputs: the logprobs the runner kept filed with
their requests, and each touched request's new tokens as a
:class:`~engine.wire.messages.TokenOutput`."""

from __future__ import annotations

from engine.scheduler.request import Phase, Request
from engine.wire.messages import TokenOutput


def keep_logprobs(runner, plan) -> None:
    """File ``runner``'s logprobs of a committed step (``plan``) with their requests."""
    if not runner.logprobs and not runner.prompt_logprobs:
        return
    for it in plan.items:
        req = it.req
        record = runner.logprobs.get(req.request_id)
        if record is not None:
            req.output_logprobs.append(record)
        scored = runner.prompt_logprobs.get(req.request_id)
        if scored and req.prompt_logprobs is not None:
            for position, rec in scored:
                req.prompt_logprobs[position] = rec


def token_output(req: Request) -> TokenOutput:
    """What ``req`` produced since its last output (its new token ids, their logprobs, and
    how it ended when it has), marking those tokens emitted."""
    start = req.emitted
    new = req.output_ids[start:]
    req.emitted = len(req.output_ids)
    done = req.phase is Phase.FINISHED
    logprobs = prompt_logprobs = None
    if req.sampling.logprobs is not None:
        logprobs = req.output_logprobs[start : start + len(new)]
    if req.prompt_logprobs is not None and (new or done):
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
    return TokenOutput(
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        request_id=req.request_id,
        token_ids=new,
        finished=done,
        finish_reason=req.finish_reason if done else None,
        error_code=req.error_code,
        error_message=req.error_message,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.prompt_cached_tokens,
    )
