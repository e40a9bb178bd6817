"""What every API's answer shares: a generation run to its end, or streamed in frames,
closed and logged once.

The answer builders of each API shape (:mod:`service.api.openai.answers`,
:mod:`service.api.ollama.answers`) turn a started
:class:`~service.api.generation.Generation` into their bodies and call these: a whole
answer waits for :func:`run_to_end`; a stream hands its payloads to
:func:`stream_answer`, which frames them (Server-Sent Events for OpenAI, NDJSON for
Ollama), turns an error after the stream began into the API's error frame, and ends
it. A client that disconnects, streaming or not, has its sequences aborted in the
engine at once (the generation is closed). Each answer ends with the call's one log
line.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from service.api.chat_output import ChatOutput
from service.api.generation import Generation, Piece
from service.api.openai.schemas import ChatMessageOut
from service.common.errors import CLIENT_GONE, SERVER_ERROR, APIError

log = logging.getLogger("headroom.api")

_encoder = msgspec.json.Encoder()
# A Server-Sent Events answer is never cached, nor buffered by a proxy.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(payload: Any, status: int = 200) -> Response[bytes]:
    return Response(
        content=_encoder.encode(payload), media_type="application/json", status_code=status
    )


def log_request(gen: Generation, status: int, error: APIError | None = None) -> None:
    """The one log line of a call (id, status, tokens, TTFT, total time, and for a
    failed call its error's code and message) and its figures in the app's metrics. The
    ``error`` is marked as logged, so the exception handler that answers it writes no
    second line (:func:`service.common.errors.log_refusal`)."""
    total_s = time.perf_counter() - gen.request.started
    ttft = gen.ttft_ms
    log.info(
        "%s %s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f%s",
        gen.request_id,
        gen.request.route or "-",
        status,
        gen.prompt_tokens,
        gen.completion_tokens,
        "-" if ttft is None else f"{ttft:.1f}",
        total_s * 1000.0,
        "" if error is None else f" error={error.code or error.type}: {error.message}",
    )
    if error is not None:
        error.logged = True
    if gen.metrics is not None:
        gen.metrics.call_ended(
            gen.request.route,
            status,
            prompt_tokens=gen.prompt_tokens,
            generated_tokens=gen.completion_tokens,
            ttft_s=None if ttft is None else ttft / 1000.0,
            total_s=total_s,
        )


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return when the client goes away. The body is already read, so the next ASGI
    message the server sends on this channel is ``http.disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(gen: Generation, request: Request) -> tuple[list[str], list[str | None]] | None:
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


async def run_to_end(
    gen: Generation, request: Request
) -> tuple[list[str], list[str | None]] | None:
    """Run a generation to its end: each sequence's whole text and finish reason, or
    None when the client disconnected first (logged 499; answer it with
    :func:`gone`). The generation is closed and the call's log line written whatever
    happens.

    Raises:
        APIError: what :meth:`Generation.pieces` raises.
    """
    status = 200
    error: APIError | None = None
    try:
        result = await _collect(gen, request)
        if result is None:
            status = CLIENT_GONE
        return result
    except APIError as exc:
        status, error = exc.status, exc
        raise
    except Exception:
        status = 500  # answered by the catch-all handler in service.common.errors
        raise
    finally:
        gen.close()
        log_request(gen, status, error)


def gone() -> Response[bytes]:
    """The (unread) answer to a client that went away."""
    return Response(content=b"", status_code=CLIENT_GONE)


async def _payload(payload: Any) -> Any:
    """An error payload, awaited when its builder is a coroutine function."""
    return await payload if inspect.isawaitable(payload) else payload


async def _framed(
    gen: Generation,
    payloads: AsyncIterator[Any],
    frame: Callable[[Any], bytes],
    error_payload: Callable[[APIError], Any],
    end: bytes,
) -> AsyncIterator[bytes]:
    status = 200
    error: APIError | None = None
    try:
        try:
            async for payload in payloads:
                yield frame(payload)
        except APIError as exc:
            status, error = exc.status, exc
            yield frame(await _payload(error_payload(exc)))
        except Exception as exc:  # a bug: still end the stream in the API's shape
            log.exception("%s failed", gen.request_id)
            status = 500
            error = APIError(500, f"internal error: {exc}", type=SERVER_ERROR)
            yield frame(await _payload(error_payload(error)))
        if end:
            yield end
    except (asyncio.CancelledError, GeneratorExit):
        status = CLIENT_GONE
        raise
    finally:
        gen.close()
        log_request(gen, status, error)


def stream_answer(
    gen: Generation,
    payloads: AsyncIterator[Any],
    *,
    frame: Callable[[Any], bytes],
    error_payload: Callable[[APIError], Any],
    end: bytes = b"",
    media_type: str = "text/event-stream",
    headers: dict[str, str] | None = SSE_HEADERS,
) -> Stream:
    """A streamed answer: each payload ``frame``-d; an error raised while they are
    produced becomes ``error_payload(error)``'s frame (awaited when it is a
    coroutine; a bug's as a 500), then ``end``
    (OpenAI's ``data: [DONE]``). By default Server-Sent Events (OpenAI's streams), not
    cached or buffered on the way; Ollama's NDJSON names its ``media_type``."""
    return Stream(
        _framed(gen, payloads, frame, error_payload, end), media_type=media_type, headers=headers
    )


async def first_piece_held(gen: Generation) -> AsyncIterator[Piece]:
    """``gen.pieces()`` with its first piece already awaited, for a stream whose first
    bytes should wait for the engine: an error the engine finds before any token (a
    JSON schema its grammar compiler refuses) is then raised here, so the call answers
    with its status and JSON error body instead of a 200 stream carrying an error
    event. The generation is closed and the call logged when that happens.

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
        log_request(gen, exc.status, exc)
        raise

    async def chained() -> AsyncIterator[Piece]:
        if head is not None:
            yield head
        async for piece in pieces:
            yield piece

    return chained()


async def one_chat_answer(
    gen: Generation,
    request: Request,
    *,
    events: Callable[[ChatOutput, AsyncIterator[Piece]], AsyncIterator[Any]],
    whole: Callable[[ChatMessageOut, str | None], Response[Any]],
    frame: Callable[[Any], bytes],
    error_payload: Callable[[APIError], Any],
    media_type: str,
    headers: dict[str, str] | None = None,
) -> Response[Any]:
    """The answer of a chat call with one choice (Ollama's, Anthropic's), shaped by one
    :class:`~service.api.chat_output.ChatOutput`: when the call streams, the payloads
    of ``events(output, pieces)`` framed as :func:`stream_answer` frames them; else
    ``whole(message, finish_reason)`` of the whole answer (or :func:`gone`). A stream
    constrained by a schema waits for the engine's first piece, so a schema the grammar
    refuses is a 400 as without stream (:func:`first_piece_held`)."""
    assert gen.chat is not None
    output = ChatOutput.planned(gen.chat, gen.request.n)
    if gen.request.stream:
        pieces = await first_piece_held(gen) if gen.chat.json_schema is not None else gen.pieces()
        return stream_answer(
            gen,
            events(output, pieces),
            frame=frame,
            error_payload=error_payload,
            media_type=media_type,
            headers=headers,
        )
    result = await run_to_end(gen, request)
    if result is None:
        return gone()
    texts, reasons = result
    return whole(*output.message(texts[0], reasons[0]))
