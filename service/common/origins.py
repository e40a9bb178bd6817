"""Which browser origins and Host names may talk to the service: the allow-lists the
HTTP middleware (:class:`service.http.security.SecurityMiddleware`) and the control
plane's socket (:mod:`service.control.socket`) both apply, so they can never disagree.

A Host must be a loopback name or address, or one configured (``--allowed-host``, the
bind address); an Origin must be a Tauri origin, the Tauri dev server, one configured
(``--cors-origin``; ``*`` allows all), or the service's own on a loopback Host
(:func:`same_origin`: the dashboard at ``/ui`` calling home). Ollama's own routes take
Ollama's default origins as well (:func:`ollama_default_origin`), so a web app an Ollama
user runs on localhost works here as it does there; a refusal names the option that
allows the origin (:func:`refused_origin`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

# Tauri v2 serves its webview from these (macOS/Linux, then Windows over http and
# https); the Tauri dev server listens on 1420.
DEFAULT_ORIGINS: tuple[str, ...] = (
    "tauri://localhost",
    "http://tauri.localhost",
    "https://tauri.localhost",
    "http://localhost:1420",
)


def normalize_origin(origin: str) -> str:
    """Compare origins case-insensitively and without a trailing slash. Never raises,
    whatever the scheme (``tauri://``, ``app://``, anything a user configures)."""
    return origin.strip().rstrip("/").lower()


def host_name(host_header: str) -> str:
    """The name part of a Host header: ``"[::1]:8427"`` -> ``"::1"``,
    ``"localhost:8427"`` -> ``"localhost"``. Lower-case, trailing dot removed."""
    host = host_header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def is_loopback_host(name: str) -> bool:
    """``localhost``, a ``.localhost`` name (RFC 6761: always loopback) or a loopback
    address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` is the service's own (``http(s)://<Host header>``) on a
    loopback Host: the dashboard at ``/ui`` calling home. A foreign page cannot send
    that pair: its Origin is its own, and a DNS-rebound name is not a loopback Host."""
    if not host:
        return False
    scheme, sep, rest = origin.strip().lower().partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    return rest.rstrip("/") == host.strip().lower() and is_loopback_host(host_name(host))


# Ollama's default origins (its OLLAMA_ORIGINS list before any is added): these hosts
# over http or https on any port, and these schemes with anything after them.
_OLLAMA_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0")
_OLLAMA_SCHEMES = ("app", "file", "tauri", "vscode-webview", "vscode-file")


def ollama_default_origin(origin: str) -> bool:
    """Whether ``origin`` is one Ollama allows by default: ``http(s)://localhost``,
    ``127.0.0.1`` or ``0.0.0.0`` with any port or none, or an ``app://``, ``file://``,
    ``tauri://``, ``vscode-webview://`` or ``vscode-file://`` one. A page elsewhere
    cannot send such an Origin: the browser writes it."""
    scheme, sep, rest = normalize_origin(origin).partition("://")
    if not sep:
        return False
    if scheme in _OLLAMA_SCHEMES:
        return True
    name, _, port = rest.partition(":")
    return scheme in ("http", "https") and name in _OLLAMA_HOSTS and (not port or port.isdigit())


def refused_origin(origin: str) -> str:
    """The 403 message for a browser ``origin`` that is not allowed, naming the option
    that allows it."""
    wanted = origin.strip().rstrip("/")
    return (
        f"origin {origin!r} is not allowed: start headroom serve with --cors-origin {wanted} "
        "to allow it (HEADROOM_CORS_ORIGIN, or cors_origin in config.toml; '*' allows "
        "every origin)"
    )


class OriginPolicy:
    """The allow-lists of origins and hosts.

    Args:
        allowed_origins: origins allowed besides :data:`DEFAULT_ORIGINS`; ``"*"``
            allows every origin.
        allowed_hosts: Host names allowed besides loopback ones (e.g. the bind
            address when serving on a LAN).
    """

    def __init__(self, *, allowed_origins: Iterable[str] = (), allowed_hosts: Iterable[str] = ()) -> None:
        origins = {normalize_origin(o) for o in (*DEFAULT_ORIGINS, *allowed_origins) if o}
        self._any_origin = "*" in origins
        self._origins = frozenset(origins - {"*"})
        self._hosts = frozenset(host_name(h) for h in allowed_hosts if h)

    def origin_allowed(self, origin: str) -> bool:
        """Whether a browser's Origin header is on the list (any spelling of case or a
        trailing slash)."""
        return self._any_origin or normalize_origin(origin) in self._origins

    def host_allowed(self, host: str | None) -> bool:
        """Whether a Host header names a loopback host or an allowed one."""
        if host is None:
            return True  # HTTP/1.0 without Host: not a browser, nothing to rebind
        name = host_name(host)
        return is_loopback_host(name) or name in self._hosts


def refused_host(host: str | None) -> str:
    """The 403 message for a ``Host`` header that is not allowed (DNS rebinding's guard),
    naming the option that allows it."""
    if not host:
        return "a request without a Host header is not allowed: send Host (every HTTP/1.1 client does)"
    name = host.strip().rsplit(":", 1)[0] if not host.strip().endswith("]") else host.strip()
    return (
        f"host {host!r} is not allowed: start headroom serve with --allowed-host {name} to serve "
        "requests addressed to it (HEADROOM_ALLOWED_HOST, or allowed_host in config.toml)"
    )
