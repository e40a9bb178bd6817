"""The local token that guards the control actions and the event socket.

One random token per user, in the file ``token`` of the user's config dir
(``platformdirs.user_config_dir("headroom")``: ``~/.config/headroom`` on Linux,
``~/Library/Application Support/headroom`` on macOS, ``%LOCALAPPDATA%\\headroom`` on
Windows; ``HEADROOM_CONFIG_DIR`` overrides it). The desktop app reads the same file.

The file is created on first use, readable by its owner only (0600; the folder
0700), and written atomically: the token is written to a private temporary file that
is then hard-linked into place (a link never replaces a file), so a concurrent reader
never sees a partial token and processes racing to create it all end up with the first
one's. A file that exists but is
readable by others has its permissions narrowed (with a warning). On Windows, where
POSIX modes mean little, the file inherits the per-user folder's ACL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import sys
from pathlib import Path

from service.common.paths import CONFIG_DIR_ENV as CONFIG_DIR_ENV
from service.common.paths import config_dir

log = logging.getLogger("headroom.token")

TOKEN_FILE = "token"
TOKEN_BYTES = 32  # 256 bits, 43 URL-safe characters
_POSIX = sys.platform != "win32"


def token_path(directory: Path | None = None) -> Path:
    """Where the token lives: ``<config dir>/token``."""
    return (directory or config_dir()) / TOKEN_FILE


def new_token() -> str:
    """A fresh token: URL-safe base64 (``[A-Za-z0-9_-]``), so it is also valid in a
    WebSocket subprotocol name and a query string without escaping."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def _valid(token: str) -> bool:
    return len(token) >= 16 and all(c.isalnum() or c in "-_" for c in token)


def read_token(path: Path | None = None) -> str | None:
    """The token in ``path`` (default :func:`token_path`), or None when the file is
    missing, empty or does not hold a token."""
    path = path or token_path()
    try:
        text = path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text if _valid(text) else None


def _narrow(path: Path) -> None:
    if not _POSIX:
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o); now 0600", path, mode)
        os.chmod(path, 0o600)


def load_or_create_token(path: Path | None = None) -> str:
    """The token, creating the file (0600, atomically) when it is missing or invalid.

    Raises:
        OSError: the folder or file cannot be created or read.
    """
    path = path or token_path()
    existing = read_token(path)
    if existing is not None:
        _narrow(path)
        return existing
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(new_token() + "\n")
            f.flush()
            os.fsync(f.fileno())
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, and never replaces a file: the first wins
                break
            except FileExistsError:
                if read_token(path) is not None:
                    break  # another process created it first: use theirs
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # empty or garbage: replace it
            except OSError:  # a filesystem without hard links
                os.replace(tmp, path)
                break
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    final = read_token(path)
    if final is None:
        raise OSError(f"could not write a token to {path}")
    _narrow(path)
    return final


def service_url(host: str, port: int) -> str:
    """The root URL a client on this machine reaches the service at, ``http://<host>:<port>``:
    a wildcard bind address becomes ``127.0.0.1``; an IPv6 one is bracketed."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def dashboard_url(host: str, port: int, token: str | None = None) -> str:
    """The dashboard's address, :func:`service_url` ``/ui/``, with ``#token=<token>`` when
    given: a fragment never leaves the browser (not sent, not logged), and the page
    takes it out of the address bar and the history entry."""
    return f"{service_url(host, port)}/ui/" + (f"#token={token}" if token else "")
