"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``.

Bodies are decoded here (not by Litestar's signature model) so that every defect
in them, empty, not JSON, not an object, a wrong type, answers OpenAI's 400 with
``param``. Order of checks: body, then fields needing nothing else, then readiness
(503), model (404), admission (503 ``queue_full``, see :mod:`service.api.admission`), a
cheap lower bound on the prompt's tokens against the context (400
``context_length_exceeded`` before any tokenizing, see
:meth:`service.api.text.TextSide.min_tokens`), tokenizing (in threads; 400 for a template
refusal), context (400), submit. With ``--request-timeout``, a request still running
that many seconds after it arrived is aborted in the engine and answered 504
``request_timeout`` (in a stream: an error event, then ``[DONE]``).

Authentication (``--api-key``) is not here but in the guard of the router these
routes are mounted on (:class:`service.http.security.BearerGuard`).

Streaming answers are Server-Sent Events, ``data: {json}\\n\\n`` each, ending with
``data: [DONE]``; an error after the stream began is an ``{"error": ...}`` event,
then ``[DONE]``. A client that disconnects, streaming or not, has its sequences
aborted in the engine at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from engine.messages import EngineInfo
from service.api.admission import Ticket
from service.api.chat_generation import check_prompt_bound, request_deadline, start_chat
from service.api.errors import SERVER_ERROR, APIError, decode_body, invalid
from service.api.generation import (
    Generation,
    check_common,
    logit_bias_pairs,
    resolve_max_tokens,
    sampling_params,
    stop_strings,
)
from service.api.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ModelCard,
    ModelList,
    TextChoice,
    Usage,
)
from service.api.structured import response_schema
from service.http.state import Services

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("headroom.api")

_encoder = msgspec.json.Encoder()
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
CLIENT_GONE = 499  # nginx's code for "client closed request", used in our logs only


def _sse(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def _json(payload: Any) -> Response[bytes]:
    return Response(content=_encoder.encode(payload), media_type="application/json")


def _log_request(gen: Generation | None, request_id: str, status: int, started: float) -> None:
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


async def _respond(
    gen: Generation,
    request: Request,
    request_id: str,
    started: float,
    build: Callable[[list[str], list[str | None]], Any],
) -> Response[bytes]:
    """Non-streaming: run to the end and answer with ``build(texts, reasons)``."""
    status = 200
    try:
        result = await _collect(gen, request)
        if result is None:
            status = CLIENT_GONE
            return Response(content=b"", status_code=CLIENT_GONE)
        return _json(build(*result))
    except APIError as exc:
        status = exc.status
        raise
    except Exception:
        status = 500  # answered by the catch-all handler in service.api.errors
        raise
    finally:
        gen.close()
        _log_request(gen, request_id, status, started)


async def _stream(
    gen: Generation,
    request_id: str,
    started: float,
    first: list[bytes],
    chunks: Callable[[int, str, str | None], bytes],
    usage_chunk: Callable[[], bytes] | None,
) -> AsyncIterator[bytes]:
    """Streaming: ``first`` events, one event per piece of text, the usage event if
    asked, ``[DONE]``; an error becomes an error event before ``[DONE]``."""
    status = 200
    try:
        try:
            for event in first:
                yield event
            async for piece in gen.pieces():
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
        _log_request(gen, request_id, status, started)


def _event_stream(
    gen: Generation,
    stream_options: Any,
    chunk_type: Callable[..., Any],
    choice: Callable[[int, str, str | None, str | None], Any],
    created: int,
    model: str,
    *,
    roles: int = 0,
) -> Stream:
    """The SSE answer of a streaming call: ``chunk_type`` events (``ChatCompletionChunk``
    or ``CompletionChunk``) whose one choice ``choice(index, text, finish_reason, role)``
    builds; first one ``assistant`` role event per sequence when ``roles`` > 0; the
    usage event when ``stream_options.include_usage``."""
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
            chunk_type(id=request_id, created=created, model=model, choices=[], usage=_usage(gen))
        )

    first = [chunk(i, "", None, role="assistant") for i in range(roles)]
    return Stream(
        _stream(gen, request_id, gen.started, first, chunk, usage_chunk if include_usage else None),
        media_type="text/event-stream",
        headers=_SSE_HEADERS,
    )


async def _admit(
    request: Request, svc: Services, body_type: type[T], check: Callable[[T], R]
) -> tuple[T, R, EngineInfo, str, Ticket]:
    """What every generation call does first, in this order (so the errors come in it):
    decode the body into ``body_type`` (400), the checks common to both calls, then
    ``check(req)`` (400; its result is returned), a ready worker (503), the model name
    (404), and a place among the waiting requests (503 ``queue_full``).

    Returns:
        ``(req, check's result, the engine's facts, the model name to answer with, the
        admission ticket)``; the caller releases the ticket.
    """
    req = decode_body(await request.body(), body_type)
    check_common(req)  # type: ignore[arg-type]
    checked = check(req)
    info = svc.supervisor.check_ready()
    model = svc.check_model(req.model, info)  # type: ignore[attr-defined]
    return req, checked, info, model, svc.admission.enter()


def _usage(gen: Generation) -> Usage:
    prompt = gen.prompt_tokens
    completion = gen.completion_tokens
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _check_chat_fields(req: ChatCompletionRequest) -> None:
    """Refuse what we cannot honour instead of ignoring it (see openai_schemas)."""
    if req.logprobs or req.top_logprobs:
        raise invalid("logprobs are not supported by this server", "logprobs")
    if req.functions or req.function_call not in (None, "none", "auto"):
        # The deprecated form of tools; tools themselves: service.api.tools.
        raise invalid("functions are not supported; send tools instead", "functions")
    response_schema(req.response_format)
    if not req.messages:
        raise invalid("messages must not be empty", "messages")


def _completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Check the fields only chat has not, and return the prompts (:func:`_prompt_items`)."""
    _check_completion_fields(req)
    return _prompt_items(req.prompt)


def _check_completion_fields(req: CompletionRequest) -> None:
    if req.logprobs is not None:
        raise invalid("logprobs are not supported by this server", "logprobs")
    if req.echo:
        raise invalid("echo is not supported by this server", "echo")
    if req.suffix:
        raise invalid("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid("best_of other than n is not supported by this server", "best_of")


def _prompt_items(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of strings / token id lists.

    Raises:
        APIError: 400 ``prompt`` for an empty or mixed list.
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token id lists",
        "prompt",
    )


async def _completion_generation(
    req: CompletionRequest,
    items: list[str | list[int]],
    info: Any,
    svc: Services,
    started: float,
    ticket: Any,
) -> Generation:
    """Bound, tokenize and check each prompt, then submit (errors: see the module
    docstring)."""
    assert svc.text is not None
    logit_bias_pairs(req.logit_bias, info.vocab_size)
    for i, item in enumerate(items):
        if isinstance(item, str):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            check_prompt_bound(svc.text, [item], info.max_context_tokens, param)
    prompts: list[list[int]] = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = await svc.text.encode_prompt(item)
        else:
            ids = item
            bad = next((t for t in ids if t < 0 or t >= info.vocab_size), None)
            if bad is not None:
                raise invalid(
                    f"token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})",
                    param,
                )
        if not ids:
            raise invalid("prompt must not be empty", param)
        prompts.append(ids)
    sampling = []
    for ids in prompts:
        max_new = resolve_max_tokens(
            req.max_tokens,
            "max_tokens",
            len(ids),
            info.max_context_tokens,
            prompt_param="prompt",
            default=16,
        )
        sampling += [sampling_params(req, max_new, j, svc.sampling_defaults) for j in range(req.n)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(
        supervisor=svc.supervisor,
        text=svc.text,
        request_id=request_id,
        prompts=prompts,
        n=req.n,
        sampling=sampling,
        stops=stop_strings(req.stop),
        started=started,
        deadline=request_deadline(svc, started),
        ticket=ticket,
    )
    gen.start()
    return gen


class OpenAIController(Controller):
    """OpenAI's API under ``/v1``."""

    path = "/v1"

    @get("/models")
    async def models(self, svc: Services) -> Response[bytes]:
        """The served model. ``context_length`` (and ``max_model_len``) is the context
        one request can use *now*, prompt plus completion in tokens: the live limit,
        which follows the KV pool as it shrinks and grows (a request longer than it
        is refused with ``context_length_exceeded``). ``model_context_length`` is the
        model's own. 503 before the first worker is ready."""
        # The last worker's facts stay valid while it restarts; before the first one
        # is ready, check_ready raises NotReady (503).
        info = svc.supervisor.info or svc.supervisor.check_ready()
        cards = [
            ModelCard(
                id=name,
                created=svc.started_at,
                context_length=info.max_context_tokens,
                max_model_len=info.max_context_tokens,
                model_context_length=info.model_context_tokens,
            )
            for name in svc.model_names(info)
        ]
        return _json(ModelList(data=cards))

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, svc: Services) -> Response[Any]:
        """Chat completion, streaming (SSE) or not. Errors: see the module docstring."""
        started = time.perf_counter()
        req, _, info, model, ticket = await _admit(
            request, svc, ChatCompletionRequest, _check_chat_fields
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            gen, output = await start_chat(req, info, svc, started, ticket, request_id)
        except BaseException:
            ticket.release()
            raise
        created = int(time.time())

        if not req.stream:

            def build(texts: list[str], reasons: list[str | None]) -> ChatCompletion:
                shaped = [output.message(text, reasons[i]) for i, text in enumerate(texts)]
                choices = [
                    ChatChoice(index=i, message=message, finish_reason=reason)
                    for i, (message, reason) in enumerate(shaped)
                ]
                return ChatCompletion(
                    id=request_id, created=created, model=model, choices=choices, usage=_usage(gen)
                )

            return await _respond(gen, request, request_id, started, build)

        return _event_stream(
            gen, req.stream_options, ChatCompletionChunk, output.deltas, created, model, roles=req.n
        )

    @post("/completions", status_code=200)
    async def completions(self, request: Request, svc: Services) -> Response[Any]:
        """Text completion of a raw prompt (no chat template), streaming or not."""
        started = time.perf_counter()
        req, items, info, model, ticket = await _admit(
            request, svc, CompletionRequest, _completion_prompts
        )
        try:
            gen = await _completion_generation(req, items, info, svc, started, ticket)
        except BaseException:
            ticket.release()
            raise
        request_id = gen.request_id
        created = int(time.time())

        if not req.stream:

            def build(texts: list[str], reasons: list[str | None]) -> Completion:
                choices = [
                    TextChoice(index=i, text=text, finish_reason=reasons[i])
                    for i, text in enumerate(texts)
                ]
                return Completion(
                    id=request_id, created=created, model=model, choices=choices, usage=_usage(gen)
                )

            return await _respond(gen, request, request_id, started, build)

        def choice(index: int, text: str, reason: str | None, _role: str | None) -> Any:
            return TextChoice(index=index, text=text, finish_reason=reason)

        return _event_stream(gen, req.stream_options, CompletionChunk, choice, created, model)
