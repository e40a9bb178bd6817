"""How one API call's :class:`~service.api.generation.Generation` becomes its HTTP
answer: a JSON body when the text is complete, or Server-Sent Events as it comes.

Streaming answers are ``data: {json}\\n\\n`` events ending with ``data: [DONE]``; an
error after the stream began is an ``{"error": ...}`` event, then ``[DONE]``. A client
that disconnects, streaming or not, has its sequences aborted in the engine at once
(the answer closes its generation). Each answer ends with the call's one log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from service.common.errors import SERVER_ERROR, APIError
from service.api.generation import Generation
from service.api.schemas import Usage

log = logging.getLogger("headroom.api")

_encoder = msgspec.json.Encoder()
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_GONE = 499  # nginx's code for "client closed request", used in our logs only


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def json_response(payload: Any) -> Response[bytes]:
    return Response(content=_encoder.encode(payload), media_type="application/json")


def log_request(gen: Generation | None, request_id: str, status: int, started: float) -> None:
    """The one log line of a request: id, status, tokens, TTFT, total time."""
    total_ms = (time.perf_counter() - started) * 1000.0
    ttft = gen.ttft_ms if gen is not None else None
    log.info(
        "%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f",
        request_id,
        status,
        gen.prompt_tokens if gen is not None else 0,
        gen.completion_tokens if gen is not None else 0,
        "-" if ttft is None else f"{ttft:.1f}",
        total_ms,
    )


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the client goes away. The body is already read, so the next ASGI
    message the server sends on this channel is ``http.disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: Generation, request: Request) -> tuple[list[str], list[str | None]] | None:
    """Run a generation to its end; None when the client disconnected first (its
    sequences are aborted by the caller's ``gen.close()``)."""
    texts = [""] * len(gen.sampling)
    reasons: list[str | None] = [None] * len(gen.sampling)

    async def run() -> None:
        async for piece in gen.pieces():
            texts[piece.index] += piece.text
            if piece.finish_reason:
                reasons[piece.index] = piece.finish_reason

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        return None
    work.result()  # raises the generation's APIError, if any
    return texts, reasons


async def respond(
    gen: Generation,
    request: Request,
    body_type: Callable[..., Any],
    choices: Callable[[list[str], list[str | None]], list[Any]],
    created: int,
    model: str,
) -> Response[bytes]:
    """Non-streaming: run to the end and answer with one ``body_type``
    (``ChatCompletion`` or ``Completion``) whose choices ``choices(texts, reasons)``
    builds, one per sequence, with the call's usage."""

    def body(texts: list[str], reasons: list[str | None]) -> Any:
        return body_type(
            id=gen.request_id,
            created=created,
            model=model,
            choices=choices(texts, reasons),
            usage=usage_of(gen),
        )

    return await respond_with(gen, request, body)


async def respond_with(
    gen: Generation, request: Request, build: Callable[[list[str], list[str | None]], Any]
) -> Response[bytes]:
    """Non-streaming, any API's shape: run to the end and answer with the JSON of
    ``build(texts, reasons)``; 499 (logged only) when the client went away first. The
    generation is closed and the request's one log line written whatever happens."""
    status = 200
    try:
        result = await _collect(gen, request)
        if result is None:
            status = CLIENT_GONE
            return Response(content=b"", status_code=CLIENT_GONE)
        return json_response(build(*result))
    except APIError as exc:
        status = exc.status
        raise
    except Exception:
        status = 500  # answered by the catch-all handler in service.common.errors
        raise
    finally:
        gen.close()
        log_request(gen, gen.request_id, status, gen.started)


async def _stream(
    gen: Generation,
    request_id: str,
    started: float,
    first: list[bytes],
    chunks: Callable[[int, str, str | None], bytes],
    usage_chunk: Callable[[], bytes] | None,
    pieces: AsyncIterator[Any] | None = None,
) -> AsyncIterator[bytes]:
    """Streaming: ``first`` events, one event per piece of text (of ``pieces``, default
    ``gen.pieces()``), the usage event if asked, ``[DONE]``; an error becomes an error
    event before ``[DONE]``."""
    status = 200
    try:
        try:
            for event in first:
                yield event
            async for piece in pieces if pieces is not None else gen.pieces():
                if piece.text:
                    yield chunks(piece.index, piece.text, None)
                if piece.finish_reason:
                    yield chunks(piece.index, "", piece.finish_reason)
            if usage_chunk is not None:
                yield usage_chunk()
        except APIError as exc:
            status = exc.status
            yield _sse(exc.body())
        except Exception as exc:  # a bug: still end the stream in OpenAI's shape
            log.exception("%s failed", request_id)
            status = 500
            yield _sse(APIError(500, f"internal error: {exc}", type=SERVER_ERROR).body())
        yield _DONE
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_GONE
        raise
    finally:
        gen.close()
        log_request(gen, request_id, status, started)


def event_stream(
    gen: Generation,
    stream_options: Any,
    chunk_type: Callable[..., Any],
    choice: Callable[[int, str, str | None, str | None], Any],
    created: int,
    model: str,
    *,
    roles: int = 0,
    pieces: AsyncIterator[Any] | None = None,
) -> Stream:
    """The SSE answer of a streaming call: ``chunk_type`` events (``ChatCompletionChunk``
    or ``CompletionChunk``) whose one choice ``choice(index, text, finish_reason, role)``
    builds (or a list of choices, one event each); first one ``assistant`` role event per sequence when ``roles`` > 0; the
    usage event when ``stream_options.include_usage``. ``pieces``: the generation's
    pieces, when the caller already took the first (:func:`first_piece_held`)."""
    include_usage = bool(stream_options and stream_options.include_usage)
    usage_field: Any = None if include_usage else msgspec.UNSET
    request_id = gen.request_id

    def chunk(index: int, text: str, reason: str | None, role: str | None = None) -> bytes:
        made = choice(index, text, reason, role)
        # A piece may make several events (a tool call's name, then its arguments).
        return b"".join(
            _sse(
                chunk_type(
                    id=request_id, created=created, model=model, choices=[c], usage=usage_field
                )
            )
            for c in (made if isinstance(made, list) else [made])
        )

    def usage_chunk() -> bytes:
        return _sse(
            chunk_type(id=request_id, created=created, model=model, choices=[], usage=usage_of(gen))
        )

    first = [chunk(i, "", None, role="assistant") for i in range(roles)]
    return Stream(
        _stream(gen, request_id, gen.started, first, chunk, usage_chunk if include_usage else None, pieces),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )


async def first_piece_held(gen: Generation) -> AsyncIterator[Any]:
    """``gen.pieces()`` with its first piece already awaited, for a stream whose first
    bytes should wait for the engine: an error the engine finds before any token (a
    JSON schema its grammar compiler refuses) is then raised here, so the call answers
    with its status and JSON error body instead of a 200 stream carrying an error
    event. The generation is closed and the request logged when that happens.

    Raises:
        APIError: what :meth:`Generation.pieces` raises before its first piece.
    """
    pieces = gen.pieces()
    try:
        head = await anext(pieces)
    except StopAsyncIteration:
        head = None
    except APIError as exc:
        gen.close()
        log_request(gen, gen.request_id, exc.status, gen.started)
        raise

    async def chained() -> AsyncIterator[Any]:
        if head is not None:
            yield head
        async for piece in pieces:
            yield piece

    return chained()


def usage_of(gen: Generation) -> Usage:
    prompt = gen.prompt_tokens
    completion = gen.completion_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
