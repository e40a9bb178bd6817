"""A chat request's way into the engine, shared by every API that chats: OpenAI's
``/v1/chat/completions`` and Ollama's ``/api/chat`` and ``/api/generate``.

Both build an OpenAI :class:`~service.api.schemas.ChatCompletionRequest` (Ollama's
routes map their fields onto one), so both get the same checks, in the same order: a
cheap lower bound on the prompt's tokens against the context (400
``context_length_exceeded`` before any tokenizing, see
:meth:`service.api.text.TextSide.min_tokens`), the chat template (in threads; 400 for a
refusal), the completion's length against the context (400), then the submission
through the supervisor, whose restarts, OOM isolation and retries apply alike.
"""

from __future__ import annotations

import msgspec

from engine.messages import EngineInfo
from engine.text.chat import template_has_tools
from service.api.admission import Ticket
from service.api.chat_output import ChatOutput
from service.api.checks import check_prompt_bound, message_texts
from service.api.generation import (
    Generation,
    logit_bias_pairs,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from service.api.reasoning import CLOSE as CLOSE_THINKING
from service.api.reasoning import reasoning_start
from service.api.schemas import ChatCompletionRequest
from service.api.structured import response_schema
from service.api.tools import plan_tools
from service.http.state import Services

# Prompt tokens decoded to see how the prompt ends (an open ``<think>``): a few tokens
# hold the tag and the newlines around it.
_TAIL_TOKENS = 8


def request_deadline(svc: Services, started: float) -> float | None:
    """``time.perf_counter()`` past which a request arrived at ``started`` is aborted
    (``--request-timeout``), or None."""
    timeout = svc.settings.request_timeout
    return started + timeout if timeout > 0 else None


async def start_chat(
    req: ChatCompletionRequest,
    info: EngineInfo,
    svc: Services,
    started: float,
    ticket: Ticket,
    request_id: str,
    *,
    context_tokens: int | None = None,
    prompt_ids: list[int] | None = None,
    default_max_tokens: int | None = None,
) -> tuple[Generation, ChatOutput]:
    """Render, bound and submit a chat request; the caller releases ``ticket`` if this
    raises.

    Args:
        req: checked by :func:`service.api.generation.check_common` already.
        info: the ready engine's facts.
        started: ``time.perf_counter()`` when the HTTP request arrived.
        request_id: the API id; engine sequences are ``{request_id}-{i}``.
        context_tokens: a smaller context than the engine's for this request
            (Ollama's ``num_ctx``); None: ``info.max_context_tokens``.
        prompt_ids: the prompt already tokenized (Ollama's raw ``/api/generate``);
            None: ``req.messages`` through the chat template.
        default_max_tokens: the answer's length when the request sets none (0: the
            rest of the context); None: ``--default-max-tokens``.

    Returns:
        The started :class:`Generation` (an unset ``max_completion_tokens`` and
        ``max_tokens`` mean ``--default-max-tokens``; 0: the rest of the context) and
        the :class:`~service.api.chat_output.ChatOutput` that shapes its answers
        (reasoning, tool calls). ``tools``/``tool_choice`` and
        ``chat_template_kwargs`` reach the template (:mod:`service.api.tools`);
        ``response_format`` constrains the answer (:mod:`service.api.structured`).

    Raises:
        APIError: 400 ``tools``/``tool_choice`` (see
            :func:`service.api.tools.plan_tools`), 400 ``context_length_exceeded`` (prompt or prompt plus completion),
            400 for a template refusal (as ``ChatTemplateError``), 503 when no worker
            is ready.
    """
    assert svc.text is not None
    logit_bias_pairs(req.logit_bias, info.vocab_size)
    schema = response_schema(req.response_format)
    context = info.max_context_tokens
    if context_tokens is not None:
        context = min(context, context_tokens)
    tokenizer = svc.text.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    plan = plan_tools(req.tools, req.tool_choice, template, template_has_tools(tokenizer))
    if prompt_ids is None:
        check_prompt_bound(svc.text, message_texts(req.messages), context, "messages")
        prompt_ids = await svc.text.encode_chat(
            req.messages, tools=plan.tools, template_kwargs=req.chat_template_kwargs
        )
    # How the answer is split: the prompt's end says whether it opened a thinking block.
    thinking = reasoning_start(template, tokenizer.decode(prompt_ids[-_TAIL_TOKENS:]))
    if plan.prefix:
        # A forced call is the answer itself: a thinking block the prompt opened is
        # closed before it (empty), and the answer has no reasoning to split.
        opened = CLOSE_THINKING + "\n\n" if thinking else ""
        prompt_ids = prompt_ids + await svc.text.encode_text(opened + plan.prefix)
        thinking = None if thinking is None else False
    output = ChatOutput(n=req.n, thinking=thinking, tools=plan)
    if plan.schema is not None:
        schema = plan.schema  # a forced call: its arguments are the answer
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    max_new = resolve_max_tokens(
        requested,
        param,
        len(prompt_ids),
        context,
        prompt_param="messages",
        default=(
            svc.settings.default_max_tokens if default_max_tokens is None else default_max_tokens
        )
        or None,
    )
    gen = Generation(
        supervisor=svc.supervisor,
        text=svc.text,
        request_id=request_id,
        prompts=[prompt_ids],
        n=req.n,
        sampling=[
            msgspec.structs.replace(
                sampling_params(req, max_new, i, svc.sampling_defaults), json_schema=schema
            )
            for i in range(req.n)
        ],
        stops=stop_strings(req.stop),
        started=started,
        deadline=request_deadline(svc, started),
        ticket=ticket,
    )
    gen.start()
    return gen, output
