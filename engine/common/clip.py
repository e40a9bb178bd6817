"""Input echoed back in an error message or a log line, cut to a readable length.

A refusal names what it refuses, but a 200 KB value echoed whole makes a 200 KB answer
and log line; :func:`clip` keeps its start and says how long it was.
"""

from __future__ import annotations

# Characters of an echoed value kept; a longer one ends with "... (N characters)".
ECHO_LIMIT = 200


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` as is when at most ``limit`` characters, else its first ``limit``
    characters and ``"... (N characters)"``, N its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"
