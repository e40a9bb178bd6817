"""The bodies of OpenAI's Responses API (``POST /v1/responses``), as msgspec structs.

The request decodes leniently, as the chat body does: unknown fields are ignored, and
the fields this stateless server cannot honour are declared so that setting them is a
400 naming them (:mod:`service.api.openai.responses_input`). ``input`` items stay
plain objects here: their many types are read, and refused, item by item there.

The answer is a :class:`ResponseObject` whose ``output`` holds, in order, a
:class:`ReasoningItem` (a thinking model's reasoning), a :class:`MessageItem` (the
text) and one :class:`FunctionCallItem` per tool call, each present only when the
answer has it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from service.api.openai.schemas import TokenCount
from service.api.sampling import Sampling


class Reasoning(msgspec.Struct, kw_only=True):
    """``reasoning``: ``effort`` (none, minimal, low, medium, high: its values are
    checked by :func:`service.api.thinking.effort_thinking`) and ``summary`` (OpenAI's
    values, taken and echoed; no summary is made). Typed, so that one of another JSON
    type is the decoder's ``invalid_type`` naming ``reasoning.effort``, as chat's
    ``reasoning_effort`` is, and a summary OpenAI does not define is a 400 naming
    ``reasoning.summary``; OpenAI's other fields are ignored."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Sampling, kw_only=True):
    """``POST /v1/responses``. ``input``: a string (one user message) or a list of
    items (messages, ``function_call``, ``function_call_output``, ``reasoning``).
    ``instructions``: a system message put first. ``max_output_tokens`` absent means
    ``--default-max-tokens``. ``tools`` are Responses' flat functions (``{"type":
    "function", "name", "description", "parameters", "strict"}``). ``text.format``
    is structured output; ``reasoning.effort`` turns thinking off or on with a
    budget (``reasoning.summary``: OpenAI's values only, no summary made). ``store``
    is accepted and nothing is stored; ``previous_response_id`` and ``conversation``
    are refused (send the whole input). ``include`` takes OpenAI's
    values, ``metadata`` OpenAI's map of strings (both checked by
    :mod:`service.api.openai.responses_input`). ``truncation``: ``"auto"``
    drops the oldest input items (instructions and system messages kept) until the
    prompt fits the context with room for the answer, as ``num_ctx`` truncation cuts an
    Ollama chat; ``"disabled"`` (the default) refuses a prompt too long with 400
    ``context_length_exceeded``. ``stream_options`` only with ``stream``."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None


class OutputText(msgspec.Struct, kw_only=True):
    """A message's text part."""

    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True):
    """A reasoning item's text part."""

    text: str
    type: str = "reasoning_text"


class MessageItem(msgspec.Struct, kw_only=True):
    """The answer's text (``status``: ``in_progress`` while it streams, then
    ``completed``, or ``incomplete`` when ``max_output_tokens``, the request timeout or
    an error cut it)."""

    id: str
    status: str
    content: list[OutputText]
    type: str = "message"
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, kw_only=True):
    """A thinking model's reasoning, as text (no summary is made); ``status``
    ``incomplete`` when ``max_output_tokens``, the request timeout or an error cut it."""

    id: str
    content: list[ReasoningText]
    type: str = "reasoning"
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    """One tool call: ``arguments`` is JSON text; ``call_id`` is what the
    ``function_call_output`` answering it names."""

    id: str
    call_id: str
    name: str
    arguments: str
    type: str = "function_call"
    status: str = "completed"


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    """Tokens of the prompt (``input_tokens``) and the answer (``output_tokens``,
    reasoning included; ``output_tokens_details.reasoning_tokens`` of them)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """One answer of ``POST /v1/responses`` (also inside the stream's
    ``response.*`` events). ``status``: ``in_progress`` (streams only),
    ``completed``, ``incomplete`` (``incomplete_details.reason``:
    ``max_output_tokens``, or ``request_timeout`` for a stream cut by
    ``--request-timeout``) or ``failed`` (``error``)."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[Any]
    usage: ResponseUsage | None = None
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    truncation: str = "disabled"
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: Reasoning | None = None
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
