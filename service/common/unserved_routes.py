"""Routes other servers have that headroom does not serve, with what to do instead.

A client written for Ollama or the OpenAI API calls them as a matter of course (``ollama
pull``, an embeddings call); a bare "no route" 404 leaves its user guessing whether the
server is wrong. These answer 501 in the API's own error shape, naming the way headroom
does it, or saying plainly that it does not.
"""

from __future__ import annotations

_MODELS_ARE_FILES = ("the local store is files on disk: `headroom models --json` lists them with their paths, "
                     "and a model is copied or removed there as files (its models--OWNER--NAME folder)")
_NO_EMBEDDINGS = "headroom serves text generation; it computes no embeddings"

UNSERVED_ROUTES: dict[str, str] = {
    "/api/pull": "models are downloaded with the CLI: `headroom pull REPO[:FILE]`, then served with --model NAME",
    "/api/push": "headroom uploads no models",
    "/api/create": "headroom serves GGUF files and Hugging Face folders as they are; it creates no models",
    "/api/copy": _MODELS_ARE_FILES,
    "/api/delete": _MODELS_ARE_FILES,
    "/api/embed": _NO_EMBEDDINGS,
    "/api/embeddings": _NO_EMBEDDINGS,
    "/v1/embeddings": _NO_EMBEDDINGS,
}


def unserved_path(path: str) -> str | None:
    """The route of :data:`UNSERVED_ROUTES` that ``path`` (as requested, a trailing
    slash allowed) names, else None: the metrics' label of its 501."""
    path = path.rstrip("/") or "/"
    return path if path in UNSERVED_ROUTES else None


def unserved_route(path: str) -> str | None:
    """The message for a route other servers have and headroom does not serve (``path``
    as requested, a trailing slash allowed), else None."""
    route = unserved_path(path)
    return None if route is None else f"{route} is not served by headroom: {UNSERVED_ROUTES[route]}"
