"""A small Hugging Face Hub on loopback, for ``headroom pull`` tests: the endpoints
huggingface_hub's ``model_info``, ``snapshot_download`` and ``hf_hub_download`` call,
answered from files held in memory. Point the client at it with ``HF_ENDPOINT``.

- ``GET /api/models/{repo}[/revision/{rev}]``: the repository's commit and file list.
- ``GET /api/models/{repo}/tree/{rev}``: the files with their sizes (recursive).
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: a file, with the Hub's ``X-Repo-Commit``
  and ``ETag`` headers; ``Range: bytes=N-`` is honoured (206).

Unknown repositories and files get 404 with the Hub's ``X-Error-Code``.
``cut_once`` names files whose first GET is cut halfway (the connection closes after
half the bytes), as a dropped connection would; ``requests`` records every request as
``(method, path, Range header)``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubServer:
    """``repos`` maps ``owner/name`` to ``{path in repo: bytes}``. Use as a context
    manager; ``url`` is the endpoint."""

    def __init__(self, repos: dict[str, dict[str, bytes]], cut_once: tuple[str, ...] = ()) -> None:
        self.repos = repos
        self.commits = {r: hashlib.sha1(r.encode()).hexdigest() for r in repos}
        self.cut_once = set(cut_once)
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- answers ----------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound")
            if len(parts) >= 5 and parts[4] == "tree":
                listing = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                           for p, b in sorted(self.repos[repo].items())]
                return self._json(h, listing, body)
            info = {"id": repo, "modelId": repo, "sha": self.commits[repo], "private": False,
                    "siblings": [{"rfilename": p} for p in sorted(self.repos[repo])]}
            return self._json(h, info, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, file = "/".join(parts[:2]), "/".join(parts[4:])
            if repo not in self.repos:
                return self._error(h, 404, "RepoNotFound")
            if file not in self.repos[repo]:
                return self._error(h, 404, "EntryNotFound", commit=self.commits[repo])
            return self._file(h, repo, file, body)
        return self._error(h, 404, "RepoNotFound")

    def _file(self, h: BaseHTTPRequestHandler, repo: str, file: str, body: bool) -> None:
        data = self.repos[repo][file]
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", self.commits[repo])
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if not body:
            return
        key = f"{repo}/{file}"
        if key in self.cut_once:
            self.cut_once.discard(key)
            h.wfile.write(data[start:len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(data[start:])

    def _json(self, h: BaseHTTPRequestHandler, value, body: bool) -> None:
        raw = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if body:
            h.wfile.write(raw)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, commit: str | None = None) -> None:
        raw = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)
