"""Who holds a secret: the one bearer parser and the one guard, for ``/v1`` and
``/api/control``.

Secrets are not checked on a path prefix but by :class:`BearerGuard`, a Litestar guard
on the routers that need one: ``/v1`` requires the API key (``--api-key``, when set:
:func:`api_key_guard`), ``/api/control`` the local token (:func:`token_guard`). A guard
runs after routing, so whatever spelling of a path the router accepts (``//v1/models``,
``/v1//models``, ``/%761/models``, ``/v1/./models``, a trailing slash...) reaches a
protected handler only through its guard. :func:`bearer_token` is the one parser of
``Authorization: Bearer <secret>`` (the event socket uses it too, next to its
subprotocol and query forms). Anthropic's clients send the API key as ``x-api-key: <key>``:
the guard of Anthropic's routes takes that header as well (``key_header``), and so does
any route whose handler names it in its ``opt`` (``{"key_header": "x-api-key"}``: the
models routes, which Anthropic's clients call too).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from service.common.errors import AUTHENTICATION, APIError
from service.common.token import token_path


def bearer_token(authorization: str | None) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header (scheme in any case,
    surrounding spaces ignored), else None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def secret_equal(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; False when either side is missing or empty."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


class BearerGuard:
    """A Litestar guard requiring ``Authorization: Bearer <secret>``.

    Put it in ``guards=[...]`` of the Router or Controller it protects: Litestar runs it
    after routing, for every handler below, whatever path spelling got there.

    Args:
        secret: returns the expected secret (read per request, so a rotated token
            file takes effect); None or empty means no secret is configured and every
            request passes.
        message: the 401 message (what to send, where the secret is), or a function of
            the key header the route takes (None for none) giving it.
        code: the error's ``code`` (``"invalid_api_key"``, ``"invalid_token"``).
        key_header: a header that may carry the secret as it is instead
            (``"x-api-key"``), or None; a handler's ``opt["key_header"]`` names one for
            its route alone.

    Raises (when called):
        APIError: 401 ``authentication_error`` with ``WWW-Authenticate: Bearer``.
    """

    def __init__(
        self,
        secret: Callable[[], str | None],
        *,
        message: str | Callable[[str | None], str],
        code: str,
        key_header: str | None = None,
    ) -> None:
        self._secret = secret
        self._message = message
        self._code = code
        self._key_header = key_header

    def __call__(self, connection: Any, handler: Any = None) -> None:
        expected = self._secret()
        if not expected:
            return
        key_header = self._key_header or (getattr(handler, "opt", None) or {}).get("key_header")
        presented = bearer_token(connection.headers.get("authorization"))
        if key_header is not None and not secret_equal(presented, expected):
            presented = (connection.headers.get(key_header) or "").strip()
        if not secret_equal(presented, expected):
            raise APIError(
                401,
                self._message if isinstance(self._message, str) else self._message(key_header),
                type=AUTHENTICATION,
                code=self._code,
                headers={"WWW-Authenticate": "Bearer"},
            )


def api_key_guard(api_key: str | None, key_header: str | None = None) -> BearerGuard:
    """The ``/v1`` guard: ``--api-key``, when set; ``key_header`` (Anthropic's
    ``x-api-key``) may carry it too."""

    def message(header: str | None) -> str:
        also = f"'{header}: <key>' or " if header else ""
        return f"a valid API key is required: send {also}'Authorization: Bearer <key>'"

    return BearerGuard(
        lambda: api_key,
        message=message,
        code="invalid_api_key",
        key_header=key_header,
    )


def token_guard(token: Callable[[], str | None]) -> BearerGuard:
    """The ``/api/control`` guard: the local token (``token()``, read per request)."""
    return BearerGuard(
        token,
        message="the local token is required: send 'Authorization: Bearer <token>' "
        f"(the token is in {token_path()})",
        code="invalid_token",
    )
