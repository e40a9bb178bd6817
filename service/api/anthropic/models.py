"""Anthropic's models endpoints, ``GET /v1/models`` and ``GET /v1/models/{id}``, on the
paths OpenAI's share: the routes (:class:`service.api.openai.routes.OpenAIController`)
answer each client its own shape, chosen by the request (:func:`asks_anthropic`).

Anthropic's clients send the ``anthropic-version`` header on every call (OpenAI's and
Ollama's never do): with it a model is ``{"type": "model", "id", "display_name",
"created_at"}`` (``created_at`` RFC 3339, UTC) and the list is ``{"data", "has_more",
"first_id", "last_id"}``, paged by ``limit`` (1 to 1000, default 20), ``after_id`` and
``before_id`` as Anthropic's API reference describes; its errors are Anthropic's
(:data:`BY_CLIENT_HANDLERS`). Without it, the shapes and errors are OpenAI's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
from litestar import Request, Response

from service.api.anthropic.errors import ANTHROPIC_EXCEPTION_HANDLERS
from service.common.errors import EXCEPTION_HANDLERS, invalid

VERSION_HEADER = "anthropic-version"
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


class AnthropicModel(msgspec.Struct, kw_only=True):
    """One model as Anthropic's ``GET /v1/models/{id}`` answers it."""

    id: str
    display_name: str
    created_at: str
    type: str = "model"


class AnthropicModelList(msgspec.Struct, kw_only=True):
    """A page of models as Anthropic's ``GET /v1/models`` answers it (``first_id`` and
    ``last_id`` None for an empty page)."""

    data: list[AnthropicModel]
    has_more: bool
    first_id: str | None
    last_id: str | None


def asks_anthropic(request: Request) -> bool:
    """Whether ``request`` comes from an Anthropic client (it sends ``anthropic-version``)."""
    return VERSION_HEADER in request.headers


def anthropic_model(name: str, display_name: str, created: int) -> AnthropicModel:
    """``name`` as Anthropic's model object; ``created``: Unix seconds."""
    when = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    return AnthropicModel(id=name, display_name=display_name, created_at=when)


def anthropic_model_list(
    names: list[str], display_name: str, created: int, query: Any
) -> AnthropicModelList:
    """The page of ``names`` the query (``limit``, ``after_id``, ``before_id``) asks for.

    Raises:
        APIError: 400 ``limit`` outside 1..1000 or not a number; 400 ``after_id`` /
            ``before_id`` naming no listed model, or both given.
    """
    raw = query.get("limit")
    try:
        limit = DEFAULT_LIMIT if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"limit must be a whole number from 1 to {MAX_LIMIT}, not {raw!r}", "limit")
    start, end = 0, len(names)
    for key in ("after_id", "before_id"):
        value = query.get(key)
        if value is not None and value not in names:
            raise invalid(f"{key} {value!r} is not a listed model; send one of {names}", key)
    if query.get("after_id") is not None and query.get("before_id") is not None:
        # A page runs one way from its cursor: both would make a page with no cursor to go on.
        raise invalid("send after_id or before_id, not both: a page goes on after one model or before it",
                      "before_id")
    if query.get("after_id") is not None:
        start = names.index(query["after_id"]) + 1
    if query.get("before_id") is not None:
        end = names.index(query["before_id"])
        start = max(start, end - limit)
        page = names[start:end]
        has_more = start > 0
    else:
        page = names[start : start + limit]
        has_more = start + limit < end
    models = [anthropic_model(name, display_name, created) for name in page]
    return AnthropicModelList(
        data=models,
        has_more=has_more,
        first_id=page[0] if page else None,
        last_id=page[-1] if page else None,
    )


def _by_client(kind: type[Exception]) -> Any:
    def handle(request: Request, exc: Exception) -> Response[Any]:
        handlers = ANTHROPIC_EXCEPTION_HANDLERS if asks_anthropic(request) else EXCEPTION_HANDLERS
        return handlers[kind](request, exc)

    return handle


# The models routes' errors (a wrong key, an unknown model...) in the asking client's shape.
BY_CLIENT_HANDLERS: dict[type[Exception], Any] = {kind: _by_client(kind) for kind in EXCEPTION_HANDLERS}
