"""The default model served behind ``--api-key`` (the ``keyed_server`` fixture, once per
session, registered in conftest.py) and raw HTTP/1.1 requests to it, for the API's
hardening tests (``test_api_hardening.py``, ``test_api_limits.py``).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from service_harness import ServerProcess, serving

KEY = "sk-hardening-0123456789"
CONTEXT_PAGES = 256  # 256 pages x 16 = 4096 tokens
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
COMPLETION = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory, default_model_dir) -> Iterator[ServerProcess]:
    """The default model behind ``--api-key`` (:data:`KEY`), :data:`CONTEXT_PAGES` KV
    pages, with at most one request waiting for the engine."""
    proc = ServerProcess(
        tmp_path_factory.mktemp("hardening"),
        ["--num-pages", str(CONTEXT_PAGES), "--api-key", KEY, "--max-queued-requests", "1"],
    )
    yield from serving(proc)


def auth(secret: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


class Raw:
    """One HTTP/1.1 answer to a request sent with its path exactly as given."""

    def __init__(self, server: ServerProcess, method: str, path: str, body=None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        try:
            payload = json.dumps(body).encode() if isinstance(body, dict) else body
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=payload, headers=hdrs)
            response = conn.getresponse()
            self.status = response.status
            self.headers = {k.lower(): v for k, v in response.getheaders()}
            self.body = response.read()
        finally:
            conn.close()

    def error(self) -> dict:
        assert self.headers["content-type"].startswith("application/json"), self.body
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error
