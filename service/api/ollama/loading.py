"""Ollama's load and unload calls, as Ollama answers them.

A ``/api/chat`` without messages, or a ``/api/generate`` without a prompt, loads the
model and answers at once (not streamed, whatever ``stream`` says)::

    {"model", "created_at", "message": {"role": "assistant", "content": ""},
     "done_reason": "load", "done": true}

(``/api/generate``'s with ``"response": ""`` in place of ``message``). With
``keep_alive`` 0 the same call unloads it instead (``done_reason: "unload"``): once
the generations in flight have finished (at most
:data:`~service.supervision.unloading.UNLOAD_DRAIN_TIMEOUT_S`), the worker stops and
gives its memory back, the supervisor is ``idle``, and the next
request loads it again (:mod:`service.supervision.unloading`). A paused engine stays
paused; one already without a worker answers at once. A call that generates with
``keep_alive`` 0 is answered, then unloads the model as Ollama does
(:func:`unload_after`): once no other request runs or waits, never ending one, unless
a request started after it (whose keep_alive is then the model's, as in Ollama).

``keep_alive`` is read as Ollama reads it (:func:`keep_alive_s`): a number of seconds
(also as text, ``"0"``, ``"-1"``), or Go's duration text (``"0s"``, ``"5m"``,
``"1h30m"``, ``"250ms"``); negative means forever. Anything else is a 400, as in Ollama. A nonzero value is accepted and
changes nothing: the model stays loaded while the server runs (or ``--keep-alive``).
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timezone
from typing import Any

from litestar import Response
from litestar.background_tasks import BackgroundTask

from service.api.ollama.models import ollama_name, rfc3339
from service.api.ollama.schemas import (
    OllamaChatChunk,
    OllamaChatRequest,
    OllamaGenerateChunk,
    OllamaGenerateRequest,
    OllamaMessage,
)
from service.api.responses import json_response
from service.api.services import Services
from service.common.errors import invalid
from service.supervision.unloading import UNLOADABLE

log = logging.getLogger("headroom.api")

UNLOAD_REASON = "unloaded by a keep_alive 0 request (Ollama's API); the next request loads it again"

# Go's time.ParseDuration units, in seconds.
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
_PART = re.compile(r"(\d+\.?\d*|\.\d+)([a-zµμ]*)")


def _go_duration_s(text: str) -> float:
    """Seconds of Go's duration text (``"1h30m"``, ``"-5m"``, ``"0"``).

    Raises:
        ValueError: with Go's words (``invalid duration "abc"``, ``missing unit in
            duration "5"``, ``unknown unit "d" in duration "1d"``).
    """
    body = text.lstrip("+-")
    sign = -1.0 if text.startswith("-") else 1.0
    total, at = 0.0, 0
    if not body:
        raise ValueError(f'invalid duration "{text}"')
    while at < len(body):
        match = _PART.match(body, at)
        if match is None:
            raise ValueError(f'invalid duration "{text}"')
        number, unit = match.groups()
        if not unit:
            raise ValueError(f'missing unit in duration "{text}"')
        if unit not in _UNIT_S:
            raise ValueError(f'unknown unit "{unit}" in duration "{text}"')
        total += float(number) * _UNIT_S[unit]
        at = match.end()
    return sign * total


def keep_alive_s(value: Any) -> float | None:
    """Ollama's ``keep_alive`` in seconds: None when absent, ``inf`` when negative.

    Raises:
        APIError: 400 ``keep_alive`` for text that is no Go duration, a number past
            any float or a value of another type (Ollama refuses them when it reads the
            body).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"keep_alive: unsupported type: '{type(value).__name__}'", "keep_alive")
    if isinstance(value, str):
        text = value.strip()
        try:
            # A number of seconds as text ("0", "-1", "300"), else Go's duration text.
            seconds = float(text) if _NUMBER.fullmatch(text) else _go_duration_s(text)
        except ValueError as exc:
            raise invalid(f"keep_alive: time: {exc}", "keep_alive") from None
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an integer past any float, which Ollama cannot read either
            raise invalid("keep_alive: the number is out of range", "keep_alive") from None
    return float("inf") if seconds < 0 else seconds


def wants_unload(keep_alive: Any) -> bool:
    """Whether ``keep_alive`` (checked by :func:`keep_alive_s`) asks for an unload:
    zero, in any spelling."""
    return keep_alive_s(keep_alive) == 0


def unload_after(svc: Services, answer: Response[Any], start_number: int) -> Response[Any]:
    """``answer`` (to a call that generated, with ``keep_alive`` 0, the ``start_number``-th
    request started: :meth:`Services.note_start`), unloading the model once it has been
    sent: at once when no other request runs or waits for the engine, else as soon as
    the last of them has finished (Ollama unloads such a model when its last request
    ends). As in Ollama the latest request's ``keep_alive`` is the model's: once a
    request starts after it (``"5m"``, unset, or another 0 that unloads after its own
    answer), this unload is dropped."""
    admission = svc.admission

    replaced = False

    def latest() -> bool:
        nonlocal replaced
        if svc.starts != start_number and not replaced:
            replaced = True
            log.info("a keep_alive 0 unload was dropped: a request started after it, and its "
                     "keep_alive is the model's (Ollama's rule)")
        return not replaced

    async def unload() -> None:  # on the event loop: Litestar runs a plain function in a thread
        svc.supervisor.unload_once_idle(UNLOAD_REASON, lambda: admission.waiting > 0, latest)

    answer.background = BackgroundTask(unload)
    return answer


async def load_or_unload(svc: Services, body: OllamaChatRequest | OllamaGenerateRequest) -> Response[bytes]:
    """Answer a call without messages (chat) or prompt (generate): unload the model
    for ``keep_alive`` 0, else load it and wait until it serves (see the module
    docstring).

    Raises:
        APIError: 400 for a bad ``keep_alive``; 404 for a model this server does not
            serve.
        NotReady: the model could not be loaded (503 with Retry-After).
    """
    supervisor = svc.supervisor
    name = body.model
    # The name is checked first, as Ollama does (404 before any loading), against the
    # last worker's facts while none is loaded.
    model = ollama_name(svc, supervisor.info) if supervisor.info is not None else name
    if supervisor.info is not None:
        svc.check_model(name, supervisor.info)
    if wants_unload(body.keep_alive):
        if supervisor.state in UNLOADABLE:
            # As in Ollama, the unload waits for the requests that run, and for those
            # taken before it that wait for the load or for their prompts.
            await supervisor.unload_when_done(UNLOAD_REASON, waiting=lambda: svc.admission.waiting > 0)
        reason = "unload"
    else:
        svc.note_start()
        info = await supervisor.ready()
        svc.check_model(name, info)
        model = ollama_name(svc, info)
        reason = "load"
    created = rfc3339(datetime.now(timezone.utc))
    if isinstance(body, OllamaChatRequest):
        return json_response(OllamaChatChunk(
            model=model, created_at=created, message=OllamaMessage(role="assistant", content=""),
            done=True, done_reason=reason,
        ))
    return json_response(OllamaGenerateChunk(
        model=model, created_at=created, response="", done=True, done_reason=reason
    ))
