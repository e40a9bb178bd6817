"""The one typed request every API call becomes, built once by its route.

A route decodes its body into its API's struct (:mod:`service.api.openai.schemas`,
:mod:`service.api.ollama.schemas`: the shape and the declared ranges are checked
there), then builds one :class:`GenerationRequest` (the checks that need neither the
tokenizer nor the engine are done there, once: ``stop``, ``logit_bias``'s form,
``response_format``, the API's own fields). The generation runner
(:class:`service.api.generation.Generation`) takes it into the engine: the checks that
need the engine's facts (``logit_bias`` ids, tools against the template, the prompt and
``max_tokens`` against the context) happen there, once; the engine validates the
:class:`~engine.wire.messages.GenerateRequest` once more as its own contract.

``max_tokens`` keeps its name from the body to here (Ollama's ``num_predict`` and
OpenAI's ``max_completion_tokens`` are read into it); :func:`resolve_max_tokens` turns
it into the engine's ``SamplingParams.max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from litestar.exceptions import InternalServerException

from engine.common.clip import clip
from service.api.prompts import Prompt
from service.api.sampling import Sampling
from service.common.errors import CLIENT_GONE, APIError, decode_body, invalid
from service.common.settings import BODY_READ_TIMEOUT_S

if TYPE_CHECKING:
    from litestar import Request

Body = TypeVar("Body")

# OpenAI takes up to 4 stop strings; we take more, within bounds that keep the stop
# matcher's per-token work small.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class GenerationRequest:
    """One API call as the generation runner takes it.

    Args:
        request_id: the API id (``chatcmpl-...``); engine ids are ``{request_id}-{i}``.
        started: ``time.perf_counter()`` when the HTTP request arrived
            (``--request-timeout`` counts from it, while the engine is ready).
        prompts: the call's prompts (:class:`~service.api.prompts.Prompt`); sequence
            ``i`` answers ``prompts[i // n]``.
        sampling: the sampling fields (ranges checked at decode).
        n: sequences per prompt.
        max_tokens: the completion's length asked for; None: ``default_max_tokens``.
        max_tokens_param: the field its errors name (``max_tokens``,
            ``max_completion_tokens``).
        default_max_tokens: the length when ``max_tokens`` is None; None: the rest of
            the context.
        stop: stop strings (:func:`stop_strings`).
        logit_bias: ``(token id, bias)`` pairs (ids against the vocabulary: at start).
        logprobs: alternatives per generated token, or None for no logprobs.
        echo: the prompt's tokens are scored too (text completions' ``echo`` with
            ``logprobs``).
        json_schema: the JSON schema (as text) answers are constrained to, or None.
        schema_param: the field a schema the engine refuses is blamed on
            (``response_format``; Ollama's ``format``).
        chat: answers are shaped as chat messages (a reasoning split, tool calls).
        tools: tool definitions for the template (chat only), or None.
        tool_choice: OpenAI's ``tool_choice`` (chat only).
        context_tokens: a smaller context than the engine's for this call (Ollama's
            ``num_ctx``), or None.
        truncate: a prompt too long for the context, its answer's room kept, is cut to
            fit it (a chat's oldest turns dropped, then its longest messages' starts; a
            raw prompt's first tokens: :mod:`service.api.prompt_fit`), as Ollama does
            (and Responses' ``truncation: "auto"``), instead of a 400.
        context_param: the call's own field that sets its context (Ollama's
            ``num_ctx``), named as the fix for a prompt that leaves no room for an
            answer even cut; None: the prompt is to be shortened.
        stream: the answer streams.
        route: the API route's path (``/v1/chat/completions``), set by
            :func:`read_call`; the metrics' label.
        thinking: whether a thinking model thinks (the template's
            ``enable_thinking``; False also closes any block at once); None: the
            template's default (chat only, :mod:`service.api.thinking`).
        thinking_budget: most tokens of reasoning before the thinking block is closed;
            None: no limit.
        thinking_param: the field a thinking error names (``reasoning_effort``,
            ``think``...).
    """

    request_id: str
    started: float
    prompts: tuple[Prompt, ...]
    sampling: Sampling
    n: int = 1
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    default_max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    echo: bool = False
    json_schema: str | None = None
    schema_param: str = "response_format"
    chat: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    context_tokens: int | None = None
    truncate: bool = False
    context_param: str | None = None
    stream: bool = False
    route: str = ""
    thinking: bool | None = None
    thinking_budget: int | None = None
    thinking_param: str = "reasoning_effort"


async def read_call(
    request: Request,
    schema: type[Body],
    build: Callable[[Body, str, float], GenerationRequest],
    id_prefix: str,
    separator: str = "-",
) -> tuple[Body, GenerationRequest]:
    """An API call's body decoded as ``schema`` (:func:`read_body`) and built into its
    one request (:func:`build_call`); the id is ``id_prefix``, ``separator`` and 32 hex
    digits (``chatcmpl-...``, ``resp_...``).

    Raises:
        APIError: 400 for a body that does not decode
            (:func:`service.common.errors.decode_body`), or from ``build``.
    """
    body, started = await read_body(request, schema)
    return body, build_call(request, body, build, id_prefix, started, separator)


async def read_body(request: Request, schema: type[Body]) -> tuple[Body, float]:
    """The call's body decoded as ``schema``, and the ``time.perf_counter()`` of the
    call's arrival (before its body was read).

    Raises:
        APIError: 400 for a body that does not decode; 408 or 499 from
            :func:`body_bytes`.
    """
    started = time.perf_counter()
    return decode_body(await body_bytes(request), schema), started


async def body_bytes(request: Request) -> bytes:
    """The call's body as sent, read within the app's ``--body-timeout`` (its state's
    ``body_timeout_s``; :data:`service.common.settings.BODY_READ_TIMEOUT_S` where it
    states none).

    Raises:
        APIError: 415 ``unsupported_content_encoding`` for a body sent compressed (a
            ``Content-Encoding`` other than ``identity``: it is never decompressed, and
            would otherwise be refused as invalid JSON); 408 ``body_timeout`` when the
            body does not arrive whole in time (a ``Content-Length`` larger than what
            was sent); 499 ``client_disconnected`` when the client went away before
            sending it all (logged and counted as such; the answer reaches no one).
    """
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            415,
            f"compressed request bodies are not accepted (Content-Encoding: {clip(encoding)}); "
            "send the JSON body uncompressed",
            code="unsupported_content_encoding",
        )
    timeout_s = getattr(request.app.state, "body_timeout_s", BODY_READ_TIMEOUT_S)
    try:
        return await asyncio.wait_for(request.body(), timeout_s)
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive whole within {timeout_s:g} s (is "
            "Content-Length larger than the body sent?); send the whole body",
            code="body_timeout",
        ) from None
    except InternalServerException as exc:
        # Litestar's word for an http.disconnect while the body is read.
        if "disconnected" not in str(exc.detail):
            raise
        raise APIError(
            CLIENT_GONE, "the client disconnected before sending its whole body",
            code="client_disconnected",
        ) from None


def build_call(
    request: Request,
    body: Body,
    build: Callable[[Body, str, float], GenerationRequest],
    id_prefix: str,
    started: float,
    separator: str = "-",
) -> GenerationRequest:
    """``build(body, request_id, started)``: the id is ``id_prefix``, ``separator`` and
    32 hex digits; the request's ``route`` is the route's path (:func:`route_of`).

    Raises:
        APIError: what ``build`` raises.
    """
    call = build(body, f"{id_prefix}{separator}{uuid.uuid4().hex}", started)
    return replace(call, route=route_of(request))


def route_of(request: Request) -> str:
    """The path of the route ``request`` reached (``/api/chat``), not the path as the
    client spelled it; the path itself before routing."""
    return request.scope.get("path_template") or request.url.path


def stop_strings(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """OpenAI's ``stop`` as a list (``param`` names the field in errors: Ollama's
    ``options.stop``, Anthropic's ``stop_sequences``).

    Raises:
        APIError: 400 ``param`` for more than :data:`MAX_STOP_STRINGS` strings, one
            longer than :data:`MAX_STOP_CHARS` characters, or an empty one (it would
            match everywhere: vLLM and Anthropic refuse it too).
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"{param} takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid(f"each {param} string must be at most {MAX_STOP_CHARS} characters", param)
    if not all(stops):
        raise invalid(f"{param} cannot contain an empty string: drop it, or send a string to stop at", param)
    return stops


def resolve_max_tokens(
    requested: int | None,
    param: str,
    prompt_tokens: int,
    context_tokens: int,
    *,
    prompt_param: str,
    default: int | None = None,
    context_param: str | None = None,
) -> int:
    """How many tokens a sequence may generate (the engine's ``max_new_tokens``).

    ``param`` / ``prompt_param`` name the fields blamed in errors. ``requested`` None
    means ``default`` (clamped to the rest of the context), or, with no default, the
    whole rest of the context. ``0`` is allowed and produces an empty completion
    (``finish_reason: "length"``), without running the engine unless the call scores
    its prompt (``echo`` with ``logprobs``). ``context_param``: the call's own field that
    sets ``context_tokens`` (Ollama's ``num_ctx``, whose prompts are cut to fit), named as
    the fix for a prompt that leaves no room; None: the prompt is to be shortened.

    Raises:
        APIError: 400 ``param`` for a negative value; 400 ``context_length_exceeded``
            when the prompt alone, or prompt plus ``requested``, exceeds
            ``context_tokens`` (both numbers in the message).
    """
    if requested is not None and requested < 0:
        raise invalid(f"{param} must be at least 0, got {requested}", param)
    remaining = context_tokens - prompt_tokens
    if remaining < (1 if requested != 0 else 0):
        whose = "This model's maximum context length" if context_param is None else "This call's context"
        raise invalid(
            f"{whose} is {context_tokens} tokens. However, your "
            f"prompt is {prompt_tokens} tokens, which leaves no room for a completion. "
            + ("Please shorten the prompt." if context_param is None else f"Please raise {context_param}."),
            prompt_param,
            "context_length_exceeded",
        )
    if requested is None:
        return remaining if default is None else min(default, remaining)
    if requested > remaining:
        raise invalid(
            f"This model's maximum context length is {context_tokens} tokens. However, you "
            f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, "
            f"{requested} in the completion). Please reduce the prompt or {param}.",
            param,
            "context_length_exceeded",
        )
    return requested
