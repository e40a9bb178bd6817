"""OpenAI's answers, built in one place: a started
:class:`~service.api.generation.Generation` as a ``ChatCompletion`` or ``Completion``
body, or as their Server-Sent Events.

Streams are ``data: {json}\\n\\n`` events ending with ``data: [DONE]``: a chat's first
events carry each choice's ``assistant`` role, then each piece of text makes its
events (a tool call's name, then its arguments, see
:class:`service.api.chat_output.ChatOutput`), then the finish; with
``stream_options.include_usage`` every chunk carries ``usage: null`` and a last chunk
the usage. An error after the stream began is an ``{"error": ...}`` event, then
``[DONE]`` (:func:`service.api.responses.stream_answer`). Token logprobs take OpenAI's
chat or legacy shape (:mod:`service.api.logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from service.api.chat_output import ChatOutput
from service.api.generation import Generation, Piece
from service.api.logprobs import TokenTexts
from service.api.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Delta,
    StreamOptions,
    TextChoice,
    Usage,
)
from service.api.responses import first_piece_held, gone, json_response, run_to_end, stream_answer
from service.common.errors import APIError

_encoder = msgspec.json.Encoder()
_DONE = b"data: [DONE]\n\n"


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _error_event(exc: APIError) -> dict[str, Any]:
    return exc.body()


def usage_of(gen: Generation) -> Usage:
    prompt = gen.prompt_tokens
    completion = gen.completion_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


@dataclass(frozen=True)
class _Chunks:
    """The chunks of one stream: ``chunk_type`` (``ChatCompletionChunk`` or
    ``CompletionChunk``) with the call's id, time and model; ``usage`` null on each when
    the client asked for the usage (it comes last, :meth:`usage`), else absent."""

    chunk_type: Any
    gen: Generation
    created: int
    model: str
    include_usage: bool

    def of(self, choice: Any) -> Any:
        return self.chunk_type(
            id=self.gen.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=None if self.include_usage else msgspec.UNSET,
        )

    def usage(self) -> Any:
        return self.chunk_type(
            id=self.gen.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage_of(self.gen),
        )


def _sse_answer(gen: Generation, chunks: AsyncIterator[Any]) -> Stream:
    return stream_answer(gen, chunks, frame=_sse, error_payload=_error_event, end=_DONE)


# -- chat ----------------------------------------------------------------------------


def _chat_logprobs(gen: Generation, tokens: TokenTexts | None, index: int) -> dict | None:
    return None if tokens is None else tokens.chat(gen.take_logprobs(index))


async def chat_answer(
    gen: Generation, request: Request, model: str, stream_options: StreamOptions | None
) -> Response[Any]:
    """A chat completion's answer: one ``ChatCompletion`` body, or its events when the
    call streams (a stream constrained by ``response_format`` waits for the engine's
    first piece, so a schema it refuses is a 400 as without stream)."""
    assert gen.chat is not None
    output = ChatOutput.planned(gen.chat, gen.request.n)
    tokens = gen.text.token_texts if gen.request.logprobs is not None else None
    created = int(time.time())
    if gen.request.stream:
        held = await first_piece_held(gen) if gen.chat.json_schema is not None else None
        include_usage = bool(stream_options and stream_options.include_usage)
        chunks = _Chunks(ChatCompletionChunk, gen, created, model, include_usage)
        return _sse_answer(gen, _chat_events(gen, output, tokens, chunks, held or gen.pieces()))
    result = await run_to_end(gen, request)
    if result is None:
        return gone()
    choices = []
    for i, (text, reason) in enumerate(zip(*result, strict=True)):
        message, finish = output.message(text, reason)
        choices.append(
            ChatChoice(
                index=i, message=message, finish_reason=finish, logprobs=_chat_logprobs(gen, tokens, i)
            )
        )
    return json_response(
        ChatCompletion(
            id=gen.request_id, created=created, model=model, choices=choices, usage=usage_of(gen)
        )
    )


async def _chat_events(
    gen: Generation,
    output: ChatOutput,
    tokens: TokenTexts | None,
    chunks: _Chunks,
    pieces: AsyncIterator[Piece],
) -> AsyncIterator[ChatCompletionChunk]:
    for i in range(gen.request.n):
        for choice in output.deltas(i, "", None, "assistant"):
            yield chunks.of(choice)

    def made(index: int, text: str, reason: str | None) -> list[ChatChunkChoice]:
        out = output.deltas(index, text, reason, None)
        if tokens is not None:
            # The tokens that arrived since the last chunk go with this piece's first.
            records = gen.take_logprobs(index)
            if records:
                if not out:
                    out = [ChatChunkChoice(index=index, delta=Delta())]
                out[0].logprobs = tokens.chat(records)
        return out

    async for piece in pieces:
        if piece.text:
            for choice in made(piece.index, piece.text, None):
                yield chunks.of(choice)
        if piece.finish_reason:
            for choice in made(piece.index, "", piece.finish_reason):
                yield chunks.of(choice)
    if chunks.include_usage:
        yield chunks.usage()


# -- text completions ----------------------------------------------------------------


@dataclass
class _TextShaper:
    """A text completion's choices, whole or streamed: ``echo`` puts each prompt's text
    first (in a stream, in the sequence's first chunk), and ``logprobs`` adds OpenAI's
    legacy logprobs object (with ``echo``, the prompt's tokens first).

    Args:
        gen: the started generation (``n`` sequences per prompt).
        echoes: each prompt's text when ``echo`` is set, else None.
        tokens: the tokenizer's token texts when ``logprobs`` is set, else None.
    """

    gen: Generation
    echoes: list[str] | None
    tokens: TokenTexts | None
    _started: set[int] = field(default_factory=set)
    _offsets: dict[int, int] = field(default_factory=dict)

    def _head(self, index: int) -> str:
        if index in self._started:
            return ""
        self._started.add(index)
        return self.echoes[index // self.gen.request.n] if self.echoes is not None else ""

    def _logprobs(self, index: int) -> dict | None:
        if self.tokens is None:
            return None
        pairs: list = []
        if index not in self._offsets and self.echoes is not None:
            scored = self.gen.prompt_logprobs(index)
            if scored is not None:
                pairs += zip(self.gen.prompts[index // self.gen.request.n], scored, strict=True)
        pairs += [(r.token_id, r) for r in self.gen.take_logprobs(index)]
        body, self._offsets[index] = self.tokens.legacy(pairs, self._offsets.get(index, 0))
        return body

    def choice(self, index: int, text: str, reason: str | None) -> TextChoice:
        """Sequence ``index``'s choice of a whole answer, or of a stream's chunk."""
        return TextChoice(
            index=index, text=self._head(index) + text, finish_reason=reason, logprobs=self._logprobs(index)
        )


def _echoes(gen: Generation) -> list[str] | None:
    """Each prompt's text for ``echo`` (token ids decoded), or None."""
    if not gen.request.echo:
        return None
    decode = gen.text.tokenizer.decode
    return [p.text if p.text is not None else decode(p.token_ids) for p in gen.request.prompts]


async def completion_answer(
    gen: Generation, request: Request, model: str, stream_options: StreamOptions | None
) -> Response[Any]:
    """A text completion's answer: one ``Completion`` body, or its events when the
    call streams."""
    tokens = gen.text.token_texts if gen.request.logprobs is not None else None
    shaper = _TextShaper(gen, _echoes(gen), tokens)
    created = int(time.time())
    if gen.request.stream:
        include_usage = bool(stream_options and stream_options.include_usage)
        chunks = _Chunks(CompletionChunk, gen, created, model, include_usage)
        return _sse_answer(gen, _text_events(gen, shaper, chunks))
    result = await run_to_end(gen, request)
    if result is None:
        return gone()
    choices = [shaper.choice(i, text, reason) for i, (text, reason) in enumerate(zip(*result, strict=True))]
    return json_response(
        Completion(
            id=gen.request_id, created=created, model=model, choices=choices, usage=usage_of(gen)
        )
    )


async def _text_events(
    gen: Generation, shaper: _TextShaper, chunks: _Chunks
) -> AsyncIterator[CompletionChunk]:
    async for piece in gen.pieces():
        if piece.text:
            yield chunks.of(shaper.choice(piece.index, piece.text, None))
        if piece.finish_reason:
            yield chunks.of(shaper.choice(piece.index, "", piece.finish_reason))
    if chunks.include_usage:
        yield chunks.usage()
