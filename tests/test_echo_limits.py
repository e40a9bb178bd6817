"""What a real ``headroom serve`` echoes of a request it refuses: a value cut to 200
characters with its length (a 200 KB ``kv_cache``, a 60 KB path, a 100 KB ``model``
came back whole in the answer and the log), and Ollama's words where a ``num_ctx`` too
small for any answer is the fault."""

from __future__ import annotations

import httpx
import pytest

from engine.common.clip import ECHO_LIMIT

pytestmark = pytest.mark.slow

# The answer's message around a cut value: the value's 200 characters, its length and the words.
MOST_ANSWER = ECHO_LIMIT + 600


def _longest_log_line(server) -> int:
    return max(len(line) for line in server.log().splitlines())


def _call(server, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.base_url + path, timeout=120, **kwargs)


def test_a_long_size_to_the_control_api_is_echoed_cut(real_server):
    auth = {"Authorization": f"Bearer {real_server.token}"}
    r = _call(real_server, "POST", "/api/control/cache", json={"kv_cache": "9x" * 100_000}, headers=auth)
    assert r.status_code == 400, r.text[:1000]
    message = r.json()["error"]["message"]
    assert len(message) < MOST_ANSWER and "... (200,002 characters) is not a size" in message, message
    assert _longest_log_line(real_server) < 2 * MOST_ANSWER


def test_a_long_path_in_a_405_is_echoed_cut(real_server):
    path = "/v1/models/" + "p" * 60_000
    r = _call(real_server, "DELETE", path)
    assert r.status_code == 405, r.text[:1000]
    assert len(r.text) < MOST_ANSWER and "(60,011 characters)" in r.text, r.text[:1000]
    assert "p" * (ECHO_LIMIT + 1) not in real_server.log()


def test_a_long_model_name_is_echoed_cut(real_server):
    r = _call(real_server, "POST", "/api/generate", json={"model": "m" * 100_000, "prompt": "hi", "stream": False})
    assert r.status_code == 404, r.text[:1000]
    assert len(r.text) < MOST_ANSWER and "(100,000 characters)" in r.text, r.text[:1000]
    assert "m" * (ECHO_LIMIT + 1) not in real_server.log()


def test_a_num_ctx_too_small_for_any_answer_names_num_ctx(real_server):
    """A raw prompt cut to a 1-token context leaves no room: Ollama's fix (raise num_ctx,
    docs/api.md#num_ctx-truncation), not /v1's (shorten the prompt, which is cut anyway)."""
    r = _call(real_server, "POST", "/api/generate", json={"model": "default", "prompt": "hello", "raw": True,
                                                          "stream": False, "options": {"num_ctx": 1}})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == ("This call's context is 1 tokens. However, your prompt is 1 tokens, which leaves no "
                                 "room for a completion. Please raise num_ctx."), r.text
    r = _call(real_server, "POST", "/v1/completions", json={"prompt": "hi " * 5000, "max_tokens": 1})
    assert r.status_code == 400 and "Please shorten the prompt" in r.json()["error"]["message"], r.text
