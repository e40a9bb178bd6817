"""How model names compare, on every API and on the command line: as Ollama compares them."""

from __future__ import annotations

_TAG = "latest"  # Ollama's default tag


def tagged(name: str) -> str:
    """``name`` with Ollama's default tag ``:latest`` when it has none or an empty one
    (``gpt-4:``, which Ollama reads as ``gpt-4:latest``); a tag follows the last ``:``
    of the name's last ``/`` part: ``owner/model:q4``."""
    if ":" not in name.rpartition("/")[2]:
        return f"{name}:{_TAG}"
    return name + _TAG if name.endswith(":") else name


def model_key(name: str) -> str:
    """A model name as compared: case-blind, and ``name`` the same as ``name:latest``. So
    any name ``/api/tags`` or ``/v1/models`` lists (``gpt-4:latest``) and the name it was
    given as (``gpt-4``, ``GPT-4``) work in a request on any route."""
    return tagged(name).lower()
