"""A chat request's way into the engine, shared by every API that chats: OpenAI's
``/v1/chat/completions`` and Ollama's ``/api/chat`` and ``/api/generate``.

Both build an OpenAI :class:`~service.api.schemas.ChatCompletionRequest` (Ollama's
routes map their fields onto one), so both go into the engine through the same
:meth:`~service.api.generation.Generation.start`, with the same checks in the same
order: admission (503 ``queue_full``), ``logit_bias`` against the vocabulary, then the
chat's own steps (:class:`ChatSteps`: ``response_format``, ``tools``/``tool_choice``,
400s), a cheap lower bound on the prompt's tokens against the context (400
``context_length_exceeded`` before any tokenizing, see
:meth:`service.api.text.TextSide.min_tokens`), the chat template (in threads; 400 for a
refusal), the completion's length against the context (400), then the submission
through the worker link, whose restarts, OOM isolation and retries apply alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.wire.messages import EngineInfo
from engine.text.chat import template_has_tools
from service.api.chat_output import ChatOutput
from service.api.generation import CallSteps, Generation, MaxTokens, stop_strings
from service.api.prompts import Prompt, chat_prompt
from service.api.reasoning import CLOSE as CLOSE_THINKING
from service.api.reasoning import reasoning_start
from service.api.schemas import ChatCompletionRequest
from service.api.structured import response_schema
from service.api.text import TextSide
from service.api.tools import ToolPlan, plan_tools
from service.api.services import Services

# Prompt tokens decoded to see how the prompt ends (an open ``<think>``): a few tokens
# hold the tag and the newlines around it.
_TAIL_TOKENS = 8


def call_generation(
    svc: Services, request_id: str, req: Any, started: float, context_tokens: int | None = None
) -> Generation:
    """A call's generation, not started yet.

    Args:
        req: the checked request (its ``n`` and ``stop``).
        started: ``time.perf_counter()`` when the HTTP request arrived;
            ``--request-timeout`` after it, the call is aborted.
        context_tokens: a smaller context than the engine's (Ollama's ``num_ctx``), or
            None.
    """
    assert svc.text is not None
    timeout = svc.settings.request_timeout
    return Generation(
        supervisor=svc.supervisor,
        text=svc.text,
        request_id=request_id,
        n=req.n,
        stops=stop_strings(req.stop),
        started=started,
        deadline=started + timeout if timeout > 0 else None,
        defaults=svc.sampling_defaults,
        context_tokens=context_tokens,
    )


@dataclass
class ChatSteps(CallSteps):
    """A chat's own steps inside :meth:`Generation.start`: its ``response_format`` and
    tools checked (:meth:`check`), its prompt continued with a forced call's opening
    (:meth:`continued`), and from the prompt's end, the :class:`ChatOutput` that shapes
    its answers (reasoning, tool calls).

    Args:
        req: the chat request.
        text: the tokenizer side (its chat template says the tool-call format and
            whether the model thinks).
    """

    req: ChatCompletionRequest
    text: TextSide
    plan: ToolPlan = field(default_factory=ToolPlan)
    output: ChatOutput | None = None

    @property
    def template(self) -> str | None:
        template = getattr(self.text.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def check(self) -> None:
        """The JSON schema answers are constrained to (``response_format``, or a forced
        call's) and the tool plan.

        Raises:
            APIError: 400 ``response_format``
                (:func:`service.api.structured.response_schema`); 400
                ``tools``/``tool_choice`` (:func:`service.api.tools.plan_tools`).
        """
        self.json_schema = response_schema(self.req.response_format)
        self.plan = plan_tools(
            self.req.tools,
            self.req.tool_choice,
            self.template,
            template_has_tools(self.text.tokenizer),
        )
        if self.plan.schema is not None:
            self.json_schema = self.plan.schema  # a forced call: its arguments are the answer

    async def continued(self, prompt_ids: list[int]) -> list[int]:
        # How the answer is split: the prompt's end says whether it opened a thinking block.
        tail = self.text.tokenizer.decode(prompt_ids[-_TAIL_TOKENS:])
        thinking = reasoning_start(self.template, tail)
        if self.plan.prefix:
            # A forced call is the answer itself: a thinking block the prompt opened is
            # closed before it (empty), and the answer has no reasoning to split.
            opened = CLOSE_THINKING + "\n\n" if thinking else ""
            prompt_ids = prompt_ids + await self.text.encode_text(opened + self.plan.prefix)
            thinking = None if thinking is None else False
        self.output = ChatOutput(n=self.req.n, thinking=thinking, tools=self.plan)
        return prompt_ids


async def start_chat(
    req: ChatCompletionRequest,
    info: EngineInfo,
    svc: Services,
    started: float,
    request_id: str,
    *,
    context_tokens: int | None = None,
    raw_prompt: str | None = None,
    default_max_tokens: int | None = None,
) -> tuple[Generation, ChatOutput]:
    """Admit, render, bound and submit a chat request (the request's place among the
    waiting ones is given back if this raises).

    Args:
        req: checked by :func:`service.api.generation.check_common` already.
        info: the ready engine's facts.
        started: ``time.perf_counter()`` when the HTTP request arrived.
        request_id: the API id; engine sequences are ``{request_id}-{i}``.
        context_tokens: a smaller context than the engine's for this request
            (Ollama's ``num_ctx``); None: ``info.max_context_tokens``.
        raw_prompt: a prompt tokenized as is, without the chat template (Ollama's raw
            ``/api/generate``); None: ``req.messages`` through the chat template.
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
        APIError: 503 ``queue_full``; 400 ``logit_bias``; 400 ``response_format``; 400
            ``tools``/``tool_choice`` (see :func:`service.api.tools.plan_tools`); 400
            ``context_length_exceeded`` (prompt or prompt plus completion).
        engine.text.chat.ChatTemplateError: a template refusal (answered 400).
        NotReady: no worker ready.
    """
    assert svc.text is not None
    if raw_prompt is not None:
        prompts = [Prompt("prompt", text=raw_prompt)]
    else:
        prompts = chat_prompt(req.messages, req.tools or None, req.chat_template_kwargs)
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = req.max_tokens, "max_tokens"
    if default_max_tokens is None:
        default_max_tokens = svc.settings.default_max_tokens
    max_tokens = MaxTokens(requested, param, prompts[0].param, default=default_max_tokens or None)
    steps = ChatSteps(req, svc.text)
    gen = call_generation(svc, request_id, req, started, context_tokens)
    await gen.start(svc.admission, info, req, prompts, max_tokens, steps)
    assert steps.output is not None
    return gen, steps.output
