"""The dashboard page at ``/ui``: the files of ``ui-bridge/dashboard`` (a wheel's copy
of them in an installed package, :mod:`service.common.resources`), served by Litestar's static
files.

``/ui`` redirects to ``/ui/`` (keeping the query: the page uses relative URLs), and so
does ``/`` for a browser (:data:`root_redirect`), where a person typing the address
lands; any other client asking ``/`` (``GET`` or ``HEAD``) learns that the server runs,
200 ``headroom is running``, as Ollama answers its clients there. Only the
plain files directly inside the directory with a known extension when the router is
made (and the page and its script, built or not: see below) are served, each with ``Cache-Control: no-cache`` and a Content-Security-Policy
that lets the page talk only to its own origin and run only its own script; any other
path answers the service's 404.

The page's script is built from ``ui-bridge``'s TypeScript, not committed: in a source
tree where nobody built it, ``/ui/`` answers 503 with a page naming the fix (and
``/ui/app.js`` a 503 error saying the same) instead of a blank page; the API serves on.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from litestar import MediaType, Request, Response, Router, get
from litestar.datastructures import CacheControlHeader
from litestar.response import Redirect
from litestar.static_files import create_static_files_router

from service.common.errors import EXCEPTION_HANDLERS, NOT_FOUND, SERVER_ERROR, APIError
from service.common.resources import DASHBOARD_BUNDLE, dashboard_problem, data_dir

_UI_SUFFIXES = (".html", ".js", ".css", ".map", ".svg")
# The page only talks to its own origin, runs only its own script, and may not be framed.
UI_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def default_dashboard_dir() -> Path:
    """The built dashboard: the wheel's copy, else ``ui-bridge/dashboard`` of the source
    tree (:func:`service.common.resources.data_dir`)."""
    return data_dir("dashboard")


def not_built_page(problem: str) -> Response[str]:
    """``/ui/``'s answer (503) while the dashboard is not built: ``problem`` (from
    :func:`service.common.resources.dashboard_problem`) for a person, who reloads once it is
    built."""
    body = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<title>headroom: the dashboard is not built</title></head>"
        '<body style="font-family: sans-serif; max-width: 46em; margin: 3em auto">'
        "<h1>The dashboard is not built</h1>"
        f"<p>{escape(problem)}.</p>"
        "<p>Then reload this page. The API serves meanwhile.</p></body></html>"
    )
    return Response(body, status_code=503, media_type=MediaType.HTML)


def dashboard_router(directory: Path | None = None, *, path: str = "/ui") -> Router:
    """A router serving ``directory`` (default: :func:`default_dashboard_dir`) at
    ``path``/, ``index.html`` for the folder itself."""
    root = (directory or default_dashboard_dir()).resolve()
    names = (
        {p.name for p in root.glob("*") if p.is_file() and p.suffix in _UI_SUFFIXES}
        if root.is_dir()
        else set()
    ) | {"index.html", DASHBOARD_BUNDLE}  # answered, built or not: see below

    def only_known_files(request: Request[Any, Any, Any]) -> Response[Any] | None:
        # The raw path: the router has already normalized the decoded one, and "/ui" and
        # "/ui/" reach the same handler.
        raw = request.scope.get("raw_path") or request.scope["path"].encode()
        tail = raw.decode("latin-1").split("?", 1)[0][len(path) :]
        if tail == "":
            query = request.url.query
            return Redirect(path + "/" + (f"?{query}" if query else ""))
        name = tail.lstrip("/") or "index.html"
        if name not in names:
            raise APIError(404, f"no such file: {name}", type=NOT_FOUND)
        if name in ("index.html", DASHBOARD_BUNDLE):
            problem = dashboard_problem(root)  # looked at each time: built while serving
            if problem is not None and name == "index.html":
                return not_built_page(problem)
            if problem is not None:
                raise APIError(503, problem, type=SERVER_ERROR)
        return None

    def add_csp(response: Response[Any]) -> Response[Any]:
        response.headers["Content-Security-Policy"] = UI_CSP
        return response

    return create_static_files_router(
        path=path,
        directories=[root],
        html_mode=True,
        name="dashboard",
        before_request=only_known_files,
        after_request=add_csp,
        cache_control=CacheControlHeader(no_cache=True),
        exception_handlers=EXCEPTION_HANDLERS,
    )


RUNNING = "headroom is running"


@get("/", include_in_schema=False, name="root")
async def root_redirect(request: Request[Any, Any, Any]) -> Response[str] | Redirect:
    """``/``: a browser (it accepts ``text/html``) is sent to the dashboard, where a
    person who types the service's address lands; any other client gets 200
    :data:`RUNNING` (Ollama's clients ping ``HEAD /`` and read a status from 400 on as
    "not running")."""
    if "text/html" in request.headers.get("accept", ""):
        return Redirect("/ui/")
    return Response(RUNNING, media_type=MediaType.TEXT)
