"""What a chat's answer will be, decided on its way into the engine: the tool plan
(checked against the model's template), the JSON schema its answers are constrained
to, the prompt's continuation for a forced tool call, and whether its answers start
inside a thinking block, or whether they are harmony messages (gpt-oss).

Two steps of :meth:`service.api.generation.Generation.start`: :func:`plan_chat` before
the prompt is tokenized (its 400s come after admission, as they need the tokenizer's
template), :func:`continue_prompt` after. The answer builders shape text with the
plan (:class:`service.api.chat_output.ChatOutput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.text.chat import template_has_tools
from engine.wire.messages import ThinkingBudget
from service.api.harmony import (
    FINAL_OPENING,
    THINKING_CLOSE,
    THINKING_OPEN,
    HarmonyParser,
    harmony_lead,
    template_is_harmony,
)
from service.api.harmony import START as HARMONY_START
from service.api.reasoning import CLOSE as CLOSE_THINKING
from service.api.reasoning import OPEN as OPEN_THINKING
from service.api.reasoning import reasoning_start
from service.api.request import GenerationRequest
from service.api.text import TextSide
from service.api.thinking import budget_tokens
from service.api.tools import ToolPlan, plan_tools

# Prompt tokens decoded to see how the prompt ends (an open ``<think>``): a few tokens
# hold the tag and the newlines around it.
_TAIL_TOKENS = 8


@dataclass
class ChatPlan:
    """A chat's answers as the engine will write them.

    Attributes:
        tools: the :class:`~service.api.tools.ToolPlan` (no tools: an empty plan).
        json_schema: the schema every answer is constrained to (``response_format``,
            or a forced call's arguments), or None.
        thinking: None (no reasoning split), or whether answers start inside a
            thinking block (known once :func:`continue_prompt` ran).
        budget_tokens: the most reasoning tokens asked for (0: thinking off), or None.
        thinking_budget: the engine's cap on the thinking block
            (:mod:`engine.sampling.thinking`), set by :func:`continue_prompt` for a
            template that thinks and a call with a budget, else None.
        harmony: the answers are harmony messages (:mod:`service.api.harmony`):
            their text keeps the special tokens, and ``thinking`` stays None.
        primer: harmony's text the answers continue: the prompt's last header (from
            its ``<|start|>``, a body it opened included) and what the server added.
    """

    tools: ToolPlan = field(default_factory=ToolPlan)
    json_schema: str | None = None
    thinking: bool | None = None
    budget_tokens: int | None = None
    thinking_budget: ThinkingBudget | None = None
    harmony: bool = False
    primer: str = ""


def chat_template(text: TextSide) -> str | None:
    """The tokenizer's chat template text, or None."""
    template = getattr(text.tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def plan_chat(request: GenerationRequest, text: TextSide) -> ChatPlan:
    """The tool plan and the answers' schema of a chat request.

    Raises:
        APIError: 400 ``tools``/``tool_choice`` (:func:`service.api.tools.plan_tools`).
    """
    template = chat_template(text)
    tools = plan_tools(request.tools, request.tool_choice, template, template_has_tools(text.tokenizer))
    # A forced call: its arguments are the answer.
    schema = tools.schema if tools.schema is not None else request.json_schema
    budget = budget_tokens(request.thinking, request.thinking_budget)
    return ChatPlan(tools=tools, json_schema=schema, budget_tokens=budget, harmony=template_is_harmony(template))


async def continue_prompt(plan: ChatPlan, text: TextSide, prompt_ids: list[int]) -> list[int]:
    """A chat prompt's token ids as the engine gets them; sets ``plan.thinking`` from
    how the prompt ends (an open thinking block), and ``plan.thinking_budget``."""
    if plan.harmony:
        return await _continue_harmony(plan, text, prompt_ids)
    tail = text.tokenizer.decode(prompt_ids[-_TAIL_TOKENS:])
    thinking = reasoning_start(chat_template(text), tail)
    if plan.tools.prefix:
        # A forced call is the answer itself: a thinking block the prompt opened is
        # closed before it (empty), and the answer has no reasoning to split.
        opened = CLOSE_THINKING + "\n\n" if thinking else ""
        prompt_ids = prompt_ids + await text.encode_text(opened + plan.tools.prefix)
        thinking = None if thinking is None else False
    plan.thinking = thinking
    # A grammar-constrained answer (a schema, a forced call) has no free block to cap.
    constrained = plan.tools.prefix or plan.json_schema is not None
    if thinking is not None and not constrained and plan.budget_tokens is not None:
        plan.thinking_budget = ThinkingBudget(
            tokens=plan.budget_tokens,
            close_ids=tuple(await text.encode_text(CLOSE_THINKING)),
            open_ids=() if thinking else tuple(await text.encode_text(OPEN_THINKING)),
        )
    return prompt_ids


async def _continue_harmony(plan: ChatPlan, text: TextSide, prompt_ids: list[int]) -> list[int]:
    """:func:`continue_prompt` of a harmony chat; sets ``plan.primer``. A forced call,
    or a schema's answer in the final channel, continues the prompt (a body the prompt
    opened is closed first); else a budget caps the analysis message the answer opens
    (or the prompt opened)."""
    tail = text.tokenizer.decode(prompt_ids[-_TAIL_TOKENS:])
    plan.primer = tail[tail.rfind(HARMONY_START) :] if HARMONY_START in tail else ""
    opened = HarmonyParser()
    opened.prime(plan.primer)
    if plan.tools.prefix or plan.json_schema is not None:
        lead = harmony_lead(opened) + ("" if plan.tools.prefix else FINAL_OPENING)
        plan.primer += lead
        return prompt_ids + await text.encode_text(lead + plan.tools.prefix)
    if plan.budget_tokens is not None:
        plan.thinking_budget = ThinkingBudget(
            tokens=plan.budget_tokens,
            close_ids=tuple(await text.encode_text(THINKING_CLOSE)),
            open_ids=() if opened.in_reasoning else tuple(await text.encode_text(THINKING_OPEN)),
        )
    return prompt_ids
