"""``headroom bench serve``: load a running server and measure what a client sees.

Sends N streaming chat requests (C at a time, greedy, EOS ignored so each runs exactly
``max_tokens``), and prints TTFT and ITL percentiles and throughput. Then, unless told
not to, runs the same prompts through the engine *in this process* (same model
folder and KV/scheduler sizes as the server's, read from ``/api/status``) and prints
the service's overhead: what HTTP, SSE, IPC and detokenizing add to the engine alone.
The engine import is lazy, inside :func:`run_engine_alone`: only that mode loads torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

# Sent first on both sides: loads lazily built state, caches the chat template's
# system prompt, and is not one of the measured prompts.
WARM_UP_PROMPT = "Say hello."
_TOPICS = (
    "the history of tea",
    "how bridges carry weight",
    "why the sky is blue",
    "the life of honey bees",
    "how a compiler works",
    "the water cycle",
    "the rules of chess",
    "how vaccines train immunity",
)


class BenchRefused(Exception):
    """The benchmark cannot run as asked (a ``--url`` that is no service's root, requests
    that do not fit the server's context); the message names the fix."""


class ContextExceeded(Exception):
    """The server refused a request with 400 ``context_length_exceeded`` (its message)."""


@dataclass(frozen=True)
class BenchOptions:
    """``url``: the server's base URL. ``num_requests`` sent, ``concurrency`` at once.
    ``max_tokens`` generated per request. ``prompt_words``: prompt length, in words.
    ``engine_baseline``: also run the engine in-process. ``device``: its device.
    ``client_processes``: the client's processes, the requests and the concurrency split
    between them (:func:`run_http_split`)."""

    url: str
    num_requests: int = 32
    concurrency: int = 32
    max_tokens: int = 64
    prompt_words: int = 64
    api_key: str | None = None
    engine_baseline: bool = True
    device: str = "auto"
    client_processes: int = 1


@dataclass
class Timing:
    """One request: seconds from send to first token, gaps between tokens, tokens."""

    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0


@dataclass
class Result:
    label: str
    timings: list[Timing]
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.timings)


def make_prompts(n: int, words: int, nonce: str = "") -> list[str]:
    """``n`` different prompts of about ``words`` words each.

    ``nonce`` starts every prompt, so a run never hits prefix-cache pages left by an
    earlier run (on the server) that the in-process engine would not have.
    """
    prompts = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        filler = " ".join(f"detail{(i * 7 + j) % 97}" for j in range(max(0, words - 12)))
        prompts.append(f"{nonce}Request {i}: write a long essay about {topic}. Notes: {filler}")
    return prompts


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def _error_of(text: str) -> dict[str, Any]:
    """The OpenAI error object of a refusal's body (empty when it holds none)."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


async def _one(client: httpx.AsyncClient, prompt: str, opts: BenchOptions) -> Timing:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": opts.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    timing: Timing | None = None
    last = sent
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode()
            error = _error_of(text)
            if r.status_code == 400 and error.get("code") == "context_length_exceeded":
                raise ContextExceeded(error.get("message", text))
            raise RuntimeError(f"HTTP {r.status_code}: {text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.perf_counter()
            if event.get("usage") and timing is not None:
                timing.tokens = event["usage"]["completion_tokens"]
            if not event.get("choices") or not event["choices"][0]["delta"].get("content"):
                continue
            if timing is None:
                timing = Timing(ttft_s=now - sent)
            else:
                timing.itl_s.append(now - last)
            last = now
    if timing is None:
        raise RuntimeError("a request produced no text")
    return timing


async def run_http(opts: BenchOptions, prompts: list[str], warm: bool = True) -> Result:
    """Send ``prompts`` to the server, ``opts.concurrency`` at a time, after the warm-up
    prompt when ``warm`` (no prompts: the warm-up alone)."""
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=opts.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=opts.url, headers=headers, timeout=600.0, limits=limits
    ) as client:
        if warm:
            await _one(client, WARM_UP_PROMPT, opts)
        gate = asyncio.Semaphore(opts.concurrency)

        async def limited(prompt: str) -> Timing:
            async with gate:
                return await _one(client, prompt, opts)

        started = time.perf_counter()
        timings = await asyncio.gather(*(limited(p) for p in prompts))
        wall_s = time.perf_counter() - started
    return Result("service (HTTP)", list(timings), wall_s)


# Streams one client process reads: the client's JSON and HTTP work is about 100 us a
# token on one core (measured on a 2-core x86-64 host against a fake engine, docs/benchmarks.md),
# so one process would cap 64 streams near 10,000 tokens/s, about a fast GPU's batched decode.
STREAMS_PER_CLIENT_PROCESS = 16


def auto_client_processes(concurrency: int, cores: int | None = None) -> int:
    """One client process per :data:`STREAMS_PER_CLIENT_PROCESS` streams, at most the
    cores (``os.cpu_count()`` when None) less two (the service's loop and its worker)."""
    cores = cores or os.cpu_count() or 1
    return max(1, min(math.ceil(concurrency / STREAMS_PER_CLIENT_PROCESS), cores - 2))


def _client_process(opts: BenchOptions, prompts: list[str], barrier: Any, results: Any) -> None:
    """One client process: its warm-up request, then, once every process is warm, its
    prompts; puts ``(timings, start, end)`` (wall-clock seconds) or ``(None, kind,
    message)`` on ``results``."""
    try:
        asyncio.run(run_http(opts, []))
        barrier.wait()
        start = time.time()
        result = asyncio.run(run_http(opts, prompts, warm=False))
        results.put((result.timings, start, time.time()))
    except ContextExceeded as exc:
        barrier.abort()
        results.put((None, "context", str(exc)))
    except threading.BrokenBarrierError:  # another process failed (its own report says how) or never came
        results.put((None, "broken", "a client process failed or never got ready"))
    except Exception as exc:  # reported by the parent, in its words
        barrier.abort()
        results.put((None, "error", f"{type(exc).__name__}: {exc}"))


def run_http_split(opts: BenchOptions, prompts: list[str]) -> Result:
    """:func:`run_http` over ``opts.client_processes`` processes (spawned), the prompts
    dealt out in turn and the concurrency split as evenly, each process warm before any
    measured request is sent; the wall time is the first start to the last end.

    Raises:
        ContextExceeded: a process's request did not fit the server's context.
        RuntimeError: a process failed (its error), or died.
    """
    processes = min(opts.client_processes, opts.concurrency)
    if processes <= 1:
        return asyncio.run(run_http(opts, prompts))
    import multiprocessing
    import queue as queue_module
    from dataclasses import replace

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes, timeout=600), ctx.Queue()
    children = []
    for i in range(processes):
        share = replace(opts, concurrency=opts.concurrency // processes + (i < opts.concurrency % processes))
        children.append(ctx.Process(target=_client_process, args=(share, prompts[i::processes], barrier, results),
                                    daemon=True))
    for child in children:
        child.start()
    outcomes = []
    while len(outcomes) < processes:
        try:
            outcomes.append(results.get(timeout=5))
        except queue_module.Empty:
            if not any(child.is_alive() for child in children):
                raise RuntimeError("a client process died before it reported") from None
    for child in children:
        child.join(timeout=30)
    failed = {kind: message for timings, kind, message in outcomes if timings is None}
    if "context" in failed:
        raise ContextExceeded(failed["context"])
    if failed:
        raise RuntimeError(failed.get("error", failed.get("broken")))
    timings = [t for outcome in outcomes for t in outcome[0]]
    wall_s = max(o[2] for o in outcomes) - min(o[1] for o in outcomes)
    return Result(f"service (HTTP, {processes} client processes)", timings, wall_s)


def run_engine_alone(opts: BenchOptions, prompts: list[str], engine_info: dict[str, Any]) -> Result:
    """The same prompts through :class:`engine.core.engine.Engine` in this process, with the
    server's model folder and sizes. Imports torch (lazily, here)."""
    from engine.common.config import EngineConfig
    from engine.core.engine import Engine
    from engine.memory.kv_fit import NULL_PAGES
    from engine.text.chat import encode_chat
    from engine.wire.messages import GenerateRequest, SamplingParams
    from service.api.text import load_tokenizer

    model_dir = engine_info["model_dir"]
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(
        EngineConfig(
            model=model_dir,
            device=opts.device,
            page_size=engine_info["page_size"],
            num_pages=engine_info["num_pages"] + NULL_PAGES,  # the server's usable pages, plus page 0
            max_running_requests=engine_info["max_running_requests"],
            max_prefill_tokens=engine_info["max_prefill_tokens"],
        )
    )
    sampling = SamplingParams(max_new_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    ids = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in prompts]

    def request(i: int) -> GenerateRequest:
        return GenerateRequest(request_id=str(i), prompt_token_ids=ids[i], sampling=sampling)

    engine.add_request(
        GenerateRequest(request_id="warm", prompt_token_ids=ids[0], sampling=sampling)
    )
    while engine.has_work():
        engine.step()

    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    timings: dict[str, Timing] = {}
    queue = list(range(len(prompts)))
    started = time.perf_counter()
    running = 0
    while queue or engine.has_work():
        while queue and running < opts.concurrency:
            i = queue.pop(0)
            sent[str(i)] = time.perf_counter()
            engine.add_request(request(i))
            running += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids:
                t = timings.get(out.request_id)
                if t is None:
                    t = timings[out.request_id] = Timing(ttft_s=now - sent[out.request_id])
                else:
                    t.itl_s.append(now - last[out.request_id])
                t.tokens += len(out.token_ids)
                last[out.request_id] = now
            if out.finished:
                running -= 1
    wall_s = time.perf_counter() - started
    return Result("engine alone (in-process)", list(timings.values()), wall_s)


def _row(result: Result) -> list[str]:
    ttft = [t.ttft_s * 1000 for t in result.timings]
    itl = [g * 1000 for t in result.timings for g in t.itl_s]
    return [
        result.label,
        *(f"{percentile(ttft, q):.1f}" for q in (50, 90, 99)),
        *(f"{percentile(itl, q):.1f}" for q in (50, 90, 99)),
        f"{result.tokens / result.wall_s:.1f}",
        f"{len(result.timings) / result.wall_s:.2f}",
    ]


def report(results: list[Result], opts: BenchOptions) -> str:
    """The results as a text table, then the overhead of the service over the engine."""
    header = ["", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99", "tok/s", "req/s"]
    rows = [header, *(_row(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"{opts.num_requests} requests, {opts.concurrency} at a time, {opts.max_tokens} tokens "
        f"each, ~{opts.prompt_words}-word prompts (times in ms)",
        *(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ),
    ]
    if len(results) == 2:
        http, alone = results
        ttft = [percentile([t.ttft_s * 1000 for t in r.timings], 50) for r in results]
        itl = [percentile([g * 1000 for t in r.timings for g in t.itl_s], 50) for r in results]
        rate = [r.tokens / r.wall_s for r in results]
        lines.append(
            f"service overhead: TTFT p50 {ttft[0] - ttft[1]:+.1f} ms, ITL p50 "
            f"{itl[0] - itl[1]:+.1f} ms, throughput {rate[0] / rate[1]:.0%} of the engine alone"
        )
    return "\n".join(lines)


def reach(url: str) -> httpx.Response:
    """``url``'s ``/api/health`` answer, asked once (10 s): a run against a service it did
    not start checks first that one answers there, and fails at once where none does.

    Raises:
        BenchRefused: it answers 404 (``url`` is not a headroom service's root).
        SystemExit: nothing answers there.
    """
    try:
        health = httpx.get(url + "/api/health", timeout=10)
    except httpx.HTTPError as exc:
        raise SystemExit(f"headroom: error: cannot reach {url}: {exc}") from None
    if health.status_code == 404:
        raise BenchRefused(f"{url}/api/health answered 404: --url looks wrong; give the headroom service's root, "
                           "e.g. http://127.0.0.1:8427, without /v1")
    return health


def run_bench(opts: BenchOptions) -> None:
    """Run the benchmark against ``opts.url`` and print the report.

    Raises:
        BenchRefused: ``opts.url`` answers 404 (not a service's root), or a request does
            not fit the server's context (``max_tokens`` alone, or with the prompt).
        SystemExit: the server is not reachable or not ready.
    """
    health = reach(opts.url)
    try:
        status = httpx.get(opts.url + "/api/status", timeout=10)
    except httpx.HTTPError as exc:
        raise SystemExit(f"headroom: error: cannot reach {opts.url}: {exc}") from None
    if health.status_code != 200:
        raise SystemExit(f"headroom: error: the server is not ready: {health.text}")
    engine_info = (status.json().get("engine") or {}).get("info")
    if engine_info is None:
        raise SystemExit(f"headroom: error: {opts.url}/api/status names no engine: {status.text}")
    context = engine_info["max_context_tokens"]
    if opts.max_tokens >= context:
        raise BenchRefused(
            f"--max-tokens {opts.max_tokens} leaves no room for a prompt in the server's "
            f"context of {context} tokens: give --max-tokens below {context}"
        )
    print(f"model {engine_info['model_name']} on {engine_info['device']} ({engine_info['dtype']})")
    prompts = make_prompts(opts.num_requests, opts.prompt_words, nonce=f"[{uuid.uuid4().hex[:8]}] ")
    try:
        results = [run_http_split(opts, prompts)]
    except ContextExceeded as exc:
        raise BenchRefused(
            f"a ~{opts.prompt_words}-word prompt and --max-tokens {opts.max_tokens} do not fit "
            f"the server's context of {context} tokens ({exc}): lower --prompt-words or "
            "--max-tokens"
        ) from None
    if opts.engine_baseline:
        results.append(run_engine_alone(opts, prompts, engine_info))
    print(report(results, opts))
