"""Ollama's answers, built in one place: a started
:class:`~service.api.generation.Generation` as ``/api/chat``'s or ``/api/generate``'s
object, or as their NDJSON stream.

Streams (the default, as in Ollama) are one JSON object a line, the last with
``"done": true``, ``done_reason`` (``stop``, ``length``), the token counts and the
durations in nanoseconds (:func:`_timings`). A tool call goes out whole, once its
arguments are complete, its arguments an object. Asked for, ``logprobs`` go with the
line that carries their tokens' text (the whole answer's all of them), each entry as
``/v1/chat/completions`` writes it (:mod:`service.api.logprobs`). An error after the stream began is
an ``{"error": ...}`` line, then the stream ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import msgspec
from litestar import Request, Response

from service.api.chat_output import FINISH_TOOL_CALLS, ChatOutput
from service.api.generation import Generation, Piece
from service.api.ollama.models import rfc3339
from service.api.ollama.schemas import OllamaChatChunk, OllamaGenerateChunk, OllamaMessage
from service.api.openai.schemas import ChatMessageOut
from service.api.responses import json_response, one_chat_answer
from service.common.errors import APIError

_encoder = msgspec.json.Encoder()
_NDJSON = "application/x-ndjson"


def _line(payload: Any) -> bytes:
    return _encoder.encode(payload) + b"\n"


def _error_line(exc: APIError) -> dict[str, str]:
    return {"error": exc.message}


def _now() -> str:
    return rfc3339(datetime.now(timezone.utc))


def _timings(gen: Generation, done_reason: str | None) -> dict[str, Any]:
    """The last line's fields: done_reason, counts, durations (ns). The load's time is
    the wait for the model to load; the prompt's, the rest of the time to the first
    token; the answer's, the rest."""
    total_s = time.perf_counter() - gen.request.started
    ttft_s = (gen.ttft_ms or 0.0) / 1000.0
    return {
        "done_reason": done_reason or "stop",
        "total_duration": int(total_s * 1e9),
        "load_duration": int(gen.load_s * 1e9),
        "prompt_eval_count": gen.prompt_tokens,
        "prompt_eval_duration": int(max(ttft_s - gen.load_s, 0.0) * 1e9),
        "eval_count": gen.completion_tokens,
        "eval_duration": int(max(total_s - ttft_s, 0.0) * 1e9),
    }


@dataclass
class _Part:
    """What one line carries: answer text, thinking, complete tool calls."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None  # None: not asked for

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls or self.logprobs)


def _logprobs(gen: Generation) -> list[dict[str, Any]] | None:
    """The logprobs of the tokens whose text came out since the last take, in Ollama's
    list; None when the call did not ask for them."""
    if gen.request.logprobs is None:
        return None
    return gen.text.token_texts.chat(gen.take_logprobs(0))["content"]


def _ollama_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI call's name and JSON text arguments as Ollama's call (arguments an
    object; text that is not a JSON object is kept as text)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return {"function": {"name": name, "arguments": parsed}}


def _done_reason(reason: str | None) -> str | None:
    return "stop" if reason == FINISH_TOOL_CALLS else reason


def _chat_line(model: str, part: _Part, done: bool, timings: dict[str, Any]) -> OllamaChatChunk:
    message = OllamaMessage(role="assistant", content=part.content)
    if part.thinking:
        message.thinking = part.thinking
    if part.tool_calls:
        message.tool_calls = part.tool_calls
    chunk = OllamaChatChunk(model=model, created_at=_now(), message=message, done=done, **timings)
    if part.logprobs is not None:
        chunk.logprobs = part.logprobs
    return chunk


def _generate_line(
    model: str, part: _Part, done: bool, timings: dict[str, Any]
) -> OllamaGenerateChunk:
    chunk = OllamaGenerateChunk(
        model=model, created_at=_now(), response=part.content, done=done, **timings
    )
    if part.thinking:
        chunk.thinking = part.thinking
    if part.logprobs is not None:
        chunk.logprobs = part.logprobs
    return chunk


_Line = Callable[[str, _Part, bool, dict[str, Any]], Any]


async def _lines(
    gen: Generation, output: ChatOutput, model: str, line: _Line, pieces: AsyncIterator[Piece]
) -> AsyncIterator[Any]:
    reason: str | None = None
    names: dict[int, str] = {}
    async for piece in pieces:
        reason = piece.finish_reason or reason
        for choice in output.deltas(0, piece.text, piece.finish_reason, None):
            delta = choice.delta
            part = _Part(delta.content or "", delta.reasoning_content or "", logprobs=_logprobs(gen))
            for call in delta.tool_calls or []:
                if "id" in call:
                    names[call["index"]] = call["function"]["name"]
                else:
                    name = names[call["index"]]
                    part.tool_calls.append(_ollama_call(name, call["function"]["arguments"]))
            if part:
                yield line(model, part, False, {})
    yield line(model, _Part(logprobs=_logprobs(gen)), True, _timings(gen, _done_reason(reason)))


async def _answer(gen: Generation, request: Request, model: str, line: _Line) -> Response[Any]:
    """NDJSON lines as the text comes, or one object (the done line, with the whole
    answer) when it is complete; a stream constrained by ``format`` waits for the
    engine's first piece, so a schema it refuses is a 400 as without stream."""

    def whole(message: ChatMessageOut, reason: str | None) -> Response[Any]:
        calls = [
            _ollama_call(c["function"]["name"], c["function"]["arguments"])
            for c in (message.tool_calls or [])
        ]
        part = _Part(message.content or "", message.reasoning_content or "", calls, _logprobs(gen))
        return json_response(line(model, part, True, _timings(gen, _done_reason(reason))))

    return await one_chat_answer(
        gen,
        request,
        events=lambda output, pieces: _lines(gen, output, model, line, pieces),
        whole=whole,
        frame=_line,
        error_payload=_error_line,
        media_type=_NDJSON,
    )


async def chat_answer(gen: Generation, request: Request, model: str) -> Response[Any]:
    """``/api/chat``'s answer: message lines, or one object."""
    return await _answer(gen, request, model, _chat_line)


async def generate_answer(gen: Generation, request: Request, model: str) -> Response[Any]:
    """``/api/generate``'s answer: ``response`` lines, or one object."""
    return await _answer(gen, request, model, _generate_line)
