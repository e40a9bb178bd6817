"""Anthropic's answers, built in one place: a started
:class:`~service.api.generation.Generation` as a ``message`` body, or as Anthropic's
Server-Sent Events.

The text is shaped by the chat machinery every API shares
(:class:`service.api.chat_output.ChatOutput`: reasoning split off, tool calls parsed);
here it becomes content blocks: a ``thinking`` block (``signature`` empty), a ``text``
block, one ``tool_use`` block per call (``id`` ``toolu_...``, ``input`` an object).
``stop_reason``: ``tool_use`` for an answer with calls, ``max_tokens``,
``model_context_window_exceeded`` (the context ended it before ``max_tokens``),
``stop_sequence`` (with ``stop_sequence`` naming the string), else ``end_turn``.

Streams are ``event: <type>`` / ``data: <json>`` pairs: ``message_start`` (the message,
empty, with the prompt's tokens), ``ping``, then per block ``content_block_start``,
its ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``: a call's input whole, once it is parsed) and
``content_block_stop``, then ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage``) and ``message_stop``. An error after the stream began is an ``error``
event in Anthropic's shape (:mod:`service.api.anthropic.errors`), and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, Response

from engine.wire.messages import FINISH_LENGTH
from service.api.anthropic.errors import error_payload
from service.api.anthropic.schemas import (
    Message,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from service.api.chat_output import FINISH_TOOL_CALLS, ChatOutput
from service.api.generation import Generation, Piece
from service.api.openai.schemas import ChatMessageOut, Delta
from service.api.responses import SSE_HEADERS, json_response, one_chat_answer

_encoder = msgspec.json.Encoder()


def _sse(payload: Any) -> bytes:
    kind = payload["type"] if isinstance(payload, dict) else payload.type
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"


def _message_id(gen: Generation) -> str:
    """``msg_`` and the call's hex id."""
    return "msg_" + gen.request_id.partition("-")[2]


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON text arguments as Anthropic's ``input`` object (text that is no
    JSON object is kept under ``arguments``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(gen: Generation, reason: str | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of the answer's finish reason."""
    if reason == FINISH_TOOL_CALLS:
        return "tool_use", None
    if reason == FINISH_LENGTH:
        # max_tokens was cut to what the context left (requests.py).
        cut = gen.sampling and gen.sampling[0].max_new_tokens < (gen.request.default_max_tokens or 0)
        return ("model_context_window_exceeded" if cut else "max_tokens"), None
    matched = gen.stop_string(0)
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def _usage(gen: Generation) -> MessageUsage:
    return MessageUsage(input_tokens=gen.prompt_tokens, output_tokens=gen.completion_tokens)


async def message_answer(gen: Generation, request: Request, model: str) -> Response[Any]:
    """The answer to ``/v1/messages``: one ``message`` body, or its events when the
    call streams."""

    def whole(message: ChatMessageOut, reason: str | None) -> Response[Any]:
        content: list[Any] = []
        if isinstance(message.reasoning_content, str) and message.reasoning_content:
            content.append(ThinkingBlock(thinking=message.reasoning_content))
        if message.content:
            content.append(TextBlock(text=message.content))
        for call in message.tool_calls or []:
            function = call["function"]
            tool_id, tool_input = _tool_id(call["id"]), _tool_input(function["arguments"])
            content.append(ToolUseBlock(id=tool_id, name=function["name"], input=tool_input))
        stop_reason, stop_sequence = _stop(gen, reason)
        return json_response(
            Message(
                id=_message_id(gen),
                model=model,
                content=content,
                stop_reason=stop_reason,
                stop_sequence=stop_sequence,
                usage=_usage(gen),
            )
        )

    return await one_chat_answer(
        gen,
        request,
        events=lambda output, pieces: _events(gen, output, model, pieces),
        whole=whole,
        frame=_sse,
        error_payload=error_payload,
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


@dataclass
class _Blocks:
    """The content blocks of one streamed answer, one open at a time: a delta of
    another kind closes the open block and starts its own."""

    index: int = -1
    kind: str | None = None
    thought: bool = False  # a thinking block came: the text after it loses its leading whitespace

    def _start(self, block: Any) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.kind = block.__struct_config__.tag
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return out

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        """The open block's ``content_block_stop`` (none when none is open)."""
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def of(self, delta: Delta) -> list[dict[str, Any]]:
        """The events of one of :class:`ChatOutput`'s deltas."""
        out = []
        if delta.reasoning_content:
            if self.kind != "thinking":
                out += self._start(ThinkingBlock(thinking=""))
            self.thought = True
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        text = delta.content or ""
        if text and self.kind != "text" and self.thought:
            text = text.lstrip()
        if text:
            if self.kind != "text":
                out += self._start(TextBlock(text=""))
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.tool_calls or []:
            function = call["function"]
            if "id" in call:
                out += self._start(ToolUseBlock(id=_tool_id(call["id"]), name=function["name"], input={}))
            else:
                partial = json.dumps(_tool_input(function["arguments"]), ensure_ascii=False)
                out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        return out


async def _events(
    gen: Generation, output: ChatOutput, model: str, pieces: AsyncIterator[Piece]
) -> AsyncIterator[Any]:
    start = Message(
        id=_message_id(gen),
        model=model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=MessageUsage(input_tokens=gen.prompt_tokens, output_tokens=0),
    )
    yield {"type": "message_start", "message": start}
    yield {"type": "ping"}
    blocks = _Blocks()
    reason: str | None = None
    async for piece in pieces:
        for choice in output.deltas(0, piece.text, piece.finish_reason, None):
            reason = choice.finish_reason or reason
            for event in blocks.of(choice.delta):
                yield event
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop(gen, reason)
    yield {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": _usage(gen),
    }
    yield {"type": "message_stop"}
