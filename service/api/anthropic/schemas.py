"""Request and answer bodies of Anthropic's Messages API, as msgspec structs.

Shapes follow Anthropic's API reference (``POST /v1/messages``,
``POST /v1/messages/count_tokens``). Requests decode leniently where Anthropic's clients
expect it: unknown fields (``metadata``'s contents, ``cache_control`` on blocks,
``service_tier``...) are ignored. Content blocks are a tagged union on ``type``; a
block type this server does not know is a 400 naming it. ``max_tokens`` is required
and at least 1, as Anthropic requires it (0 is a 400, as Anthropic answers it);
``temperature`` is in 0..1, Anthropic's range (OpenAI's 0..2 is a 400 above 1 here);
``top_p`` and ``top_k`` take the ranges of :class:`service.api.sampling.Sampling`.

The same block structs serve both ways: the answer's ``content`` is a list of
:class:`TextBlock`, :class:`ThinkingBlock` and :class:`ToolUseBlock`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from service.api.sampling import TopK, TopP

# Anthropic's range of ``temperature`` (OpenAI's goes to 2).
AnthropicTemperature = Annotated[float, Meta(ge=0.0, le=1.0)]


class _Block(msgspec.Struct, kw_only=True, tag_field="type"):
    """A content block: ``{"type": ..., ...}``."""


class TextBlock(_Block, tag="text"):
    text: str


class ImageBlock(_Block, tag="image"):
    """Accepted in the body, refused by the request builder (no vision here)."""

    source: Any = None


class DocumentBlock(_Block, tag="document"):
    """Accepted in the body, refused by the request builder."""

    source: Any = None


class ToolUseBlock(_Block, tag="tool_use"):
    """A call the assistant made: ``id`` (``toolu_...``), the tool's ``name``, its
    ``input`` object."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    """What a call returned, in a user turn: text, or text blocks; ``is_error`` marks a
    failed call."""

    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Block, tag="thinking"):
    """A reasoning model's thinking. ``signature`` is empty: nothing is signed here."""

    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Block, tag="redacted_thinking"):
    data: str = ""


ContentBlock = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct, kw_only=True):
    """One turn: ``content`` is text or a list of blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    """A client tool: ``input_schema`` is the JSON schema of its ``input``. ``type`` is
    absent or ``custom``; Anthropic's server tools (``web_search_...``, ``bash_...``)
    are refused by the request builder."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class _ToolChoice(msgspec.Struct, kw_only=True, tag_field="type"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_ToolChoice, tag="auto"):
    pass


class ToolChoiceAny(_ToolChoice, tag="any"):
    pass


class ToolChoiceTool(_ToolChoice, tag="tool"):
    name: str


class ToolChoiceNone(_ToolChoice, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class _Thinking(msgspec.Struct, kw_only=True, tag_field="type"):
    pass


class ThinkingEnabled(_Thinking, tag="enabled"):
    """Thinking on; ``budget_tokens`` (at least 1024, below ``max_tokens``) caps it."""

    budget_tokens: int


class ThinkingDisabled(_Thinking, tag="disabled"):
    pass


class ThinkingAdaptive(_Thinking, tag="adaptive"):
    """The model decides: thinking on where its template can think, no budget."""


class ThinkingBetweenTools(_Thinking, tag="between_tools"):
    """As ``adaptive`` here."""


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools


class OutputFormat(msgspec.Struct, kw_only=True):
    """Structured output: the answer's text is a JSON value of ``schema`` (an object,
    or JSON Schema's ``true``: any value)."""

    type: Literal["json_schema"]
    schema: dict[str, Any] | bool


class OutputConfig(msgspec.Struct, kw_only=True):
    """``format`` constrains the answer; ``effort`` is accepted and unused."""

    format: OutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt's parts of a messages request."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock | ImageBlock | DocumentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class Metadata(msgspec.Struct, kw_only=True):
    """``metadata``: ``user_id`` is an opaque string or null, as Anthropic types it (another
    type is a 400 naming ``$.metadata.user_id``); unused here."""

    user_id: str | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``. ``max_tokens`` beyond what the context leaves after the
    prompt is cut to it; below 1 it is a 400, as Anthropic answers. ``output_config.format`` is
    structured output (:mod:`service.api.structured`). ``stream`` answers with Anthropic's Server-Sent Events;
    ``metadata`` is accepted and unused."""

    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: AnthropicTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class Message(msgspec.Struct, kw_only=True):
    """The answer (and, empty, a stream's ``message_start``). ``stop_reason``:
    ``end_turn``, ``max_tokens``, ``model_context_window_exceeded`` (the context ended
    it first), ``stop_sequence`` (``stop_sequence`` names it) or ``tool_use``; null in
    ``message_start``."""

    id: str
    model: str
    content: list[TextBlock | ThinkingBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct, kw_only=True):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    """``type``: ``invalid_request_error``, ``authentication_error``,
    ``permission_error``, ``not_found_error``, ``request_too_large``,
    ``rate_limit_error``, ``api_error``, ``timeout_error`` or ``overloaded_error``."""

    type: str
    message: str


class AnthropicError(msgspec.Struct, kw_only=True):
    """Every error of these routes: ``{"type": "error", "error": {...}}``."""

    error: AnthropicErrorDetail
    type: str = "error"
