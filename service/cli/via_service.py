"""``headroom generate`` through the running ``headroom serve``: when one runs
(:func:`service.cli.instance.running`) and answers, the reply streams from it in
moments instead of a second engine loading (and holding a second copy of the model).

The prompt goes to ``/v1/chat/completions`` (``--chat``, the default) or
``/v1/completions`` (``--raw``) with generate's ``--max-tokens``, ``--temperature``
and ``--seed``, streamed; the text is written as it comes, as the in-process engine
writes it. The service's own settings apply (its model, context, device): a
``--model`` it does not serve, a service that does not answer or is not ready (a
paused one stays paused) leaves the work to the in-process engine, saying why on
stderr. Any other refusal (a prompt too long for its context) is the command's error;
a service started with ``--api-key`` takes generate's ``--api-key`` (or
``HEADROOM_API_KEY``), and a refused key's error names both and ``--local``.

Light at import (httpx only when called), like the whole of :mod:`service.cli`.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from service.cli.exits import EXIT_USAGE, fail

# Seconds to connect and to wait for the answer's head (a worker that is loading
# answers 503 at once, so this bounds only a service that hangs).
CONNECT_TIMEOUT_S = 5.0
HEAD_TIMEOUT_S = 30.0


def _request(prompt: str, chat: bool, model: str | None, max_tokens: int, temperature: float | None,
             seed: int | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model or "default", "max_tokens": max_tokens, "stream": True}
    if temperature is not None:  # unset: the service's model defaults
        body["temperature"] = temperature
    if seed is not None:
        body["seed"] = seed
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _text_of(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def generate_on_service(
    info: dict[str, Any],
    *,
    prompt: str,
    chat: bool,
    model: str | None,
    max_tokens: int,
    temperature: float | None,
    seed: int | None,
    api_key: str | None,
    out: TextIO = sys.stdout,
) -> bool:
    """Stream the reply from the service ``info`` (its ``runtime.json``) to ``out``.

    Returns:
        True when the service answered (the reply is written, with its final newline);
        False when the work is the in-process engine's (why is on stderr).

    Raises:
        SystemExit: the service refused the request for a reason a second engine would
            not cure (the message, as the command's error).
    """
    import httpx

    url = str(info.get("url") or "")
    path, body = _request(prompt, chat, model, max_tokens, temperature, seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=HEAD_TIMEOUT_S)
    try:
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                try:
                    error = r.json()["error"]
                    message, code, param = error.get("message", r.text), error.get("code"), error.get("param")
                except (ValueError, KeyError, TypeError, AttributeError):
                    message, code, param = r.text, None, None
                if r.status_code == 401:
                    fail(f"the service on {url} refused the prompt: {message}; "
                         + ("the key given is not its key: " if api_key else "")
                         + "pass its key with --api-key KEY (or HEADROOM_API_KEY=KEY), "
                         "or --local to load the engine here")
                if code == "engine_paused":
                    # Paused to give its memory back (game mode): a second engine here would
                    # take that memory again behind the user's back.
                    fail(f"the service on {url} is paused, its memory given back ({message}); "
                         "pass --local to load the engine here anyway")
                if r.status_code in (404, 503) or code == "model_not_found":
                    print(f"headroom: the service on {url} cannot take it ({message}); loading the engine here",
                          file=sys.stderr)
                    return False
                from engine.text.chat import NO_CHAT_TEMPLATE

                if chat and str(message).startswith(NO_CHAT_TEMPLATE):
                    fail(f"{NO_CHAT_TEMPLATE}; pass --raw to send the prompt as it is", EXIT_USAGE)
                if code == "context_length_exceeded" and param != "max_tokens":
                    # The prompt alone is past the context: no engine here would take it either.
                    fail(f"the service on {url} refused the prompt: {message}", EXIT_USAGE)
                if code == "context_length_exceeded":
                    # The API's words name its field; a --local engine stops where the context ends.
                    fail(f"the service on {url} refused --max-tokens {max_tokens} with this prompt: "
                         f"{str(message).replace('max_tokens', '--max-tokens')} (or pass --local: the engine "
                         "here generates until the context is full)", EXIT_USAGE)
                fail(f"the service on {url} refused the prompt: {message}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    out.write("\n")
                    fail(f"the service on {url} failed the reply: {event['error'].get('message')}")
                text = _text_of(event, chat)
                if text:
                    out.write(text)
                    out.flush()
    except httpx.TransportError as exc:
        print(f"headroom: the service on {url} does not answer ({exc}); loading the engine here", file=sys.stderr)
        return False
    out.write("\n")
    return True
