"""The requests of the chaos run (:mod:`service.bench.chaos`) and how each one ended.

A run mixes, from a seeded random generator: greedy requests (short prompts, some with
stop strings, some long prompts) drawn from a small pool so each can be compared with
an undisturbed reference run of the same body; sampled requests with ``n`` > 1 and a
seed; and clients that vanish mid-answer (a stream closed after its first text). Each
is streamed or not at random. :func:`run_one` sends one and classifies the ending:

- ``ok``: 200, every choice has a ``finish_reason``, a stream ended with ``[DONE]``;
- ``failed``: an OpenAI-shaped error whose code docs/api.md and docs/serving.md document
  (:data:`DOCUMENTED_CODES`), as a response or as a stream's error event + ``[DONE]``;
- ``undocumented``: anything else (another code, a malformed body, a stream cut short,
  a refused connection);
- ``hung``: no ending within the hang limit;
- ``vanished``: the client left on purpose.

A client does what docs/serving.md asks of one: a 503 that refused the request before it ran
(``engine_restarting``, ``engine_starting``) is sent again after its ``Retry-After``
(at most :data:`MAX_RETRIES` times); only the last attempt counts.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# The errors a client may get while workers are killed, memory runs out and the pool
# shrinks (docs/serving.md): each says what happened and when to retry.
DOCUMENTED_CODES = frozenset(
    {
        "engine_restarted",
        "engine_restarting",
        "engine_starting",
        "out_of_memory",
        "context_length_exceeded",
    }
)

_TOPICS = (
    "the sea",
    "bread",
    "rivers",
    "chess",
    "owls",
    "tea",
    "volcanoes",
    "trains",
    "bees",
    "glass",
    "maps",
    "clocks",
)
# Refusals a well-behaved client retries after Retry-After; the cap on one wait, seconds.
RETRIED_CODES = frozenset({"engine_restarting", "engine_starting"})
MAX_RETRIES = 5
MAX_RETRY_WAIT_S = 30.0
_LONG_WORDS = 300  # about 900 tokens with the chat template: a long prompt's prefill


@dataclass(frozen=True)
class Spec:
    """One request to send. ``kind``: ``greedy``, ``sampled`` or ``vanish``; ``body``:
    the chat body without ``stream``; ``key``: the reference's key (greedy only)."""

    kind: str
    stream: bool
    body: dict[str, Any]
    key: int | None = None


@dataclass
class Outcome:
    """How one request ended (see the module docstring for ``status``). ``code``: the
    error's code; ``texts``: one per choice (``ok`` only); ``ttft_s``: seconds from
    sending to the first text of a stream."""

    spec: Spec
    status: str
    code: str | None = None
    texts: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    detail: str = ""
    retry_after_s: float | None = None
    retries: int = 0


def greedy_pool(max_tokens: int) -> list[dict[str, Any]]:
    """The bodies greedy requests are drawn from: short prompts, short prompts with
    stop strings, and long prompts (temperature 0, EOS honoured)."""
    pool: list[dict[str, Any]] = []
    for i, topic in enumerate(_TOPICS):
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": f"Write a short story about {topic}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if i % 3 == 2:
            body["stop"] = [".", "\n"]
        pool.append(body)
    for topic in _TOPICS[:4]:
        words = " ".join(f"{topic} {j}" for j in range(_LONG_WORDS // 2))
        pool.append(
            {
                "messages": [
                    {"role": "user", "content": f"Here are notes: {words}. Summarise them."}
                ],
                "max_tokens": max(4, max_tokens // 3),
                "temperature": 0,
            }
        )
    return pool


def make_specs(count: int, max_tokens: int, rng: random.Random) -> list[Spec]:
    """``count`` requests: about 65% greedy (from :func:`greedy_pool`), 20% sampled
    with ``n`` of 2 or 3, 15% vanishing clients; streamed or not at random."""
    pool = greedy_pool(max_tokens)
    specs = []
    for i in range(count):
        roll = rng.random()
        stream = rng.random() < 0.5
        if roll < 0.65:
            key = rng.randrange(len(pool))
            specs.append(Spec("greedy", stream, pool[key], key))
        elif roll < 0.85:
            body = {
                "messages": [{"role": "user", "content": f"Name some {_TOPICS[i % 12]}."}],
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "seed": rng.randrange(1 << 31),
                "n": rng.choice((2, 3)),
            }
            specs.append(Spec("sampled", stream, body))
        else:
            body = {
                "messages": [{"role": "user", "content": f"Tell me about {_TOPICS[i % 12]}."}],
                "max_tokens": max_tokens * 4,
                "temperature": 0,
            }
            specs.append(Spec("vanish", True, body))
    return specs


def _error_outcome(
    spec: Spec, error: Any, status: int | None = None, headers: Any = None
) -> Outcome:
    outcome = _classify_error(spec, error, status)
    retry_after = (headers or {}).get("retry-after")
    if retry_after is not None and retry_after.isdigit():
        outcome.retry_after_s = float(retry_after)
    return outcome


def _classify_error(spec: Spec, error: Any, status: int | None) -> Outcome:
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return Outcome(spec, "undocumented", detail=f"malformed error {status}: {error!r}"[:300])
    code = error.get("code")
    if code in DOCUMENTED_CODES:
        return Outcome(spec, "failed", code=code)
    return Outcome(spec, "undocumented", code=code, detail=f"{status}: {error}"[:300])


def run_one(client: httpx.Client, spec: Spec, hang_s: float) -> Outcome:
    """Send ``spec`` (again after a retried refusal, see the module docstring) and
    classify its ending; never raises for a request's fate."""
    retries = 0
    while True:
        outcome = _attempt(client, spec, hang_s)
        outcome.retries = retries
        if (
            outcome.status != "failed"
            or outcome.code not in RETRIED_CODES
            or outcome.retry_after_s is None
            or retries >= MAX_RETRIES
        ):
            return outcome
        retries += 1
        time.sleep(min(outcome.retry_after_s, MAX_RETRY_WAIT_S))


def _attempt(client: httpx.Client, spec: Spec, hang_s: float) -> Outcome:
    body = dict(spec.body, stream=spec.stream)
    try:
        if not spec.stream:
            return _plain(client, spec, body, hang_s)
        return _streamed(client, spec, body, hang_s)
    except httpx.TimeoutException:
        return Outcome(spec, "hung", detail=f"no ending within {hang_s:.0f} s")
    except httpx.HTTPError as exc:
        return Outcome(spec, "undocumented", detail=f"{type(exc).__name__}: {exc}"[:300])


def _plain(client: httpx.Client, spec: Spec, body: dict, hang_s: float) -> Outcome:
    r = client.post("/v1/chat/completions", json=body, timeout=hang_s)
    try:
        data = r.json()
    except ValueError:
        return Outcome(spec, "undocumented", detail=f"{r.status_code} not JSON: {r.text[:200]!r}")
    if r.status_code != 200:
        error = data.get("error") if isinstance(data, dict) else data
        return _error_outcome(spec, error, r.status_code, r.headers)
    choices = data.get("choices") or []
    want = body.get("n", 1)
    if len(choices) != want or any(c.get("finish_reason") is None for c in choices):
        return Outcome(spec, "undocumented", detail=f"bad choices: {choices!r}"[:300])
    texts = [c["message"]["content"] or "" for c in sorted(choices, key=lambda c: c["index"])]
    return Outcome(spec, "ok", texts=texts)


def _streamed(client: httpx.Client, spec: Spec, body: dict, hang_s: float) -> Outcome:
    want = body.get("n", 1)
    texts = [""] * want
    finished = [False] * want
    started = time.perf_counter()
    ttft: float | None = None
    deadline = time.monotonic() + hang_s
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=hang_s) as r:
        if r.status_code != 200:
            r.read()
            try:
                return _error_outcome(spec, r.json().get("error"), r.status_code, r.headers)
            except ValueError:
                return Outcome(spec, "undocumented", detail=f"{r.status_code}: {r.text[:200]!r}")
        error = None
        for line in r.iter_lines():
            if time.monotonic() > deadline:
                return Outcome(spec, "hung", detail=f"stream still open after {hang_s:.0f} s")
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                if error is not None:
                    return _error_outcome(spec, error, 200)
                if not all(finished):
                    return Outcome(spec, "undocumented", detail="[DONE] before every finish")
                return Outcome(spec, "ok", texts=texts, ttft_s=ttft)
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                continue
            for choice in event.get("choices") or []:
                content = choice["delta"].get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    texts[choice["index"]] += content
                if choice.get("finish_reason"):
                    finished[choice["index"]] = True
            if spec.kind == "vanish" and ttft is not None:
                return Outcome(spec, "vanished", ttft_s=ttft)  # leaving closes the stream
    return Outcome(spec, "undocumented", detail="the stream ended without [DONE]")
