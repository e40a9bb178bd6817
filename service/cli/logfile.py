"""Where ``headroom serve`` logs: stderr, or with ``--log-file`` a file rotated by size
(:class:`logging.handlers.RotatingFileHandler`).

Rotation: at :data:`MAX_BYTES` (10 MiB) the file becomes ``.1`` (``.1`` becomes ``.2``
...) and at most :data:`BACKUP_COUNT` (5) older files are kept, so the log never takes
more than about 60 MiB. ``auto`` is ``headroom.log`` in the user log folder
(:func:`service.common.paths.log_dir`). The macOS and Windows services pass ``--log-file auto``;
the Linux one logs to stderr, which systemd keeps in the user journal.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

from engine.common.units import MiB

MAX_BYTES = 10 * MiB
BACKUP_COUNT = 5
LOG_FILE_NAME = "headroom.log"
FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# Control characters (C0, DEL, C1, the Unicode line and paragraph separators) as Python
# writes them in a string's repr: ``\n``, ``\x00``, ``\u2028``.
# uvicorn's words for a WebSocket text frame that is not UTF-8, and ours.
UVICORN_BAD_UTF8 = "Invalid UTF-8 sequence received from client."
NOT_UTF8_MESSAGE = "a WebSocket client sent a text frame that is not UTF-8: closed it with code 1007 (invalid data)"
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)}


class OneLineFormatter(logging.Formatter):
    """:class:`logging.Formatter` with every control character of a record's message
    escaped (``\n`` -> ``\\n``): a message carries what requests sent (a path, a model
    name), and a newline there would start a line that reads as a record of its own (a
    forged ``ERROR ... worker crashed``), a NUL would make the file binary to ``grep``.
    One record is one line; a traceback (``exc_info``) is appended as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = record.message.translate(_ESCAPES)
        return super().formatMessage(record)


class ClientTextFilter(logging.Filter):
    """On uvicorn's logger: a WebSocket text frame that is not UTF-8 (a client's fault,
    which uvicorn answers with close code 1007) is one warning line, not an ERROR with
    uvicorn's traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == UVICORN_BAD_UTF8:
            record.msg, record.args = NOT_UTF8_MESSAGE, ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


def resolve_log_file(value: str | None) -> Path | None:
    """The file ``--log-file`` names (``auto``: the user log folder's headroom.log)."""
    if value is None or value == "":
        return None
    if value.strip().lower() == "auto":
        from service.common.paths import log_dir

        return log_dir() / LOG_FILE_NAME
    return Path(value).expanduser()


def setup_logging(level: str, log_file: str | None = None) -> Path | None:
    """Configure the root logger at ``level``: to the rotated ``log_file`` when given
    (its folder made), else to stderr. Returns the file's path, or None for stderr.

    Raises:
        OSError: the file or its folder cannot be created or opened.
    """
    path = resolve_log_file(log_file)
    if path is None:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.handlers.RotatingFileHandler(
            path, maxBytes=MAX_BYTES, backupCount=BACKUP_COUNT, encoding="utf-8"
        )
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ClientTextFilter) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(ClientTextFilter())
    return path
