"""``GET /metrics``: the service's figures in Prometheus's text format, one registry per
app (never ``prometheus_client``'s global one, so two apps in one process, as in the
tests, count apart).

Two kinds of figures, all named ``headroom_*``:

- **observed per API call**, where the call leaves its one log line
  (:func:`service.api.responses.log_request`; :meth:`ServiceMetrics.call_ended`) or is
  refused before it reached the engine (the exception handlers of
  :mod:`service.common.errors`; :meth:`ServiceMetrics.call_refused`): calls by API
  route and HTTP status (``outcome``; 499 for a client that went away), prompt and
  generated tokens, the time to the first token, the time between tokens
  (:meth:`ServiceMetrics.tokens_arrived`) and the call's whole time, in seconds;
- **read at each scrape** from the supervisor and the engine's last counters through a
  callable the app gives (:class:`Reading`): the supervisor's state, worker restarts,
  sequences running and waiting in the engine, calls waiting for it
  (``--max-queued-requests``' count), the KV pool's pages (the null page not counted,
  as the dashboard counts them), the prefix cache, replans, out-of-memory steps and the
  requests they failed, and the expert cache's hits and misses (only for a model with
  experts in host memory).

The route label is the route's path (``/v1/chat/completions``, ``/api/chat``), never the
path a client sent, so the label set stays small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.wire.messages import EngineStats

# What /metrics answers with (text format 0.0.4, which every scraper reads; the server
# adds the charset, UTF-8).
CONTENT_TYPE = "text/plain; version=0.0.4"

# Seconds. The time to the first token spans a cached short prompt on a GPU to a long
# prefill on the CPU; between tokens, a fast GPU's few ms to a CPU's half second.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class Reading:
    """What a scrape reads of the service now.

    Args:
        state: the supervisor's state (``ready``, ``idle``...).
        states: every state's name (each is a sample, 1 for ``state``, else 0).
        restarts: workers restarted after a crash or a hang since the service started
            (not those asked for through the control API).
        calls_waiting: API calls admitted and waiting for their first token.
        sequences_in_flight: engine sequences sent to the worker and not finished.
        stats: the engine's last counters (None: no worker has reported yet).
        oom_steps: engine steps that ran out of device memory (each rolled back).
        oom_failed_requests: requests those steps ended with ``out_of_memory``.
        replans: live changes of the engine's memory use and replans it asked for.
    """

    state: str
    states: tuple[str, ...]
    restarts: int
    calls_waiting: int
    sequences_in_flight: int
    stats: EngineStats | None
    oom_steps: int = 0
    oom_failed_requests: int = 0
    replans: int = 0


_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily


class _ReadingCollector(Collector):
    """The figures of :class:`Reading`, read at each scrape."""

    def __init__(self, read: Callable[[], Reading]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        r = self._read()
        state = GaugeMetricFamily(
            "headroom_engine_state", "The supervisor's state (1 for the current one).", labels=["state"]
        )
        for name in r.states:
            state.add_metric([name], 1.0 if name == r.state else 0.0)
        yield state
        yield from _figures((
            (_COUNTER, "headroom_worker_restarts", "Engine workers restarted after a crash or a hang since the service started.", r.restarts),
            (_GAUGE, "headroom_calls_waiting",
             "API calls admitted and waiting for their first token (--max-queued-requests counts them).",
             r.calls_waiting),
            (_GAUGE, "headroom_sequences_in_flight", "Engine sequences sent to the worker and not finished.",
             r.sequences_in_flight),
            (_COUNTER, "headroom_oom_steps", "Engine steps that ran out of device memory (each rolled back).",
             r.oom_steps),
            (_COUNTER, "headroom_oom_failed_requests", "Requests ended with out_of_memory by such a step.",
             r.oom_failed_requests),
            (_COUNTER, "headroom_replans", "Live changes of the engine's memory use, and replans it asked for.",
             r.replans),
        ))
        if r.stats is not None:
            yield from _engine_figures(r.stats)


def _engine_figures(s: EngineStats) -> Iterator[Metric]:
    """The engine's counters of one heartbeat as Prometheus figures."""
    yield from _figures((
        (_GAUGE, "headroom_requests_running", "Sequences the engine is running.", s.running),
        (_GAUGE, "headroom_requests_waiting", "Sequences waiting in the engine's queue (its queue depth).", s.waiting),
        (_GAUGE, "headroom_kv_pages_total", "Pages of the KV pool a sequence can use (the null page not counted).",
         s.total_pages),
        (_GAUGE, "headroom_kv_pages_used", "Pages of the KV pool in use (the prefix cache's included).",
         s.total_pages - s.free_pages),
        (_GAUGE, "headroom_kv_pages_cached", "Pages of the KV pool held only by the prefix cache.", s.cached_pages),
        (_COUNTER, "headroom_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens),
        (_COUNTER, "headroom_prefix_cache_lookup_tokens", "Prompt tokens looked up in the prefix cache.",
         s.prefix_lookup_tokens),
    ))
    ended = CounterMetricFamily(
        "headroom_engine_sequences_ended", "Sequences the current worker ended, by how.", labels=["how"]
    )
    for how, count in (("finished", s.finished), ("aborted", s.aborted), ("failed", s.failed)):
        ended.add_metric([how], count)
    yield ended
    if s.expert_cache_slots or s.expert_cache_hits or s.expert_cache_misses:
        yield from _figures((
            (_COUNTER, "headroom_expert_cache_hits", "Expert-steps served from the GPU expert cache.",
             s.expert_cache_hits),
            (_COUNTER, "headroom_expert_cache_misses", "Expert-steps missing from the GPU expert cache.",
             s.expert_cache_misses),
            (_COUNTER, "headroom_expert_bus_reads",
             "Expert-steps of decode read from host memory over the bus (missing from the cache).",
             s.expert_bus_reads),
            (_GAUGE, "headroom_expert_cache_slots", "Slots of the GPU expert cache now.", s.expert_cache_slots),
        ))


def _figures(rows: tuple[tuple[type, str, str, float], ...]) -> Iterator[Metric]:
    """One family of one sample per ``(kind, name, help, value)`` row."""
    for kind, name, text, value in rows:
        yield kind(name, text, value=value)


class ServiceMetrics:
    """The app's registry and what the API records into it.

    Args:
        read: what a scrape reads now (:class:`Reading`); None: only the per-call
            figures.
    """

    def __init__(self, read: Callable[[], Reading] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "headroom_requests", "API calls by route and outcome (the HTTP status; 499: the client went away).",
            ["route", "outcome"], registry=r,
        )
        self.prompt_tokens = Counter(
            "headroom_prompt_tokens", "Prompt tokens of the calls that reached the engine.", ["route"], registry=r
        )
        self.generated_tokens = Counter(
            "headroom_generation_tokens", "Tokens generated.", ["route"], registry=r
        )
        self.ttft = Histogram(
            "headroom_time_to_first_token_seconds", "From a call's arrival to its first generated token.",
            ["route"], buckets=TTFT_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "headroom_inter_token_latency_seconds", "Between two generated tokens of one sequence.",
            buckets=ITL_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "headroom_request_duration_seconds", "From a call's arrival to its answer's end.",
            ["route"], buckets=E2E_BUCKETS, registry=r,
        )
        if read is not None:
            r.register(_ReadingCollector(read))

    def call_ended(
        self,
        route: str,
        status: int,
        *,
        prompt_tokens: int,
        generated_tokens: int,
        ttft_s: float | None,
        total_s: float,
    ) -> None:
        """A call that reached the generation runner ended with ``status``."""
        route = route or "unknown"
        self.calls.labels(route, str(status)).inc()
        self.prompt_tokens.labels(route).inc(prompt_tokens)
        self.generated_tokens.labels(route).inc(generated_tokens)
        if ttft_s is not None:
            self.ttft.labels(route).observe(ttft_s)
        self.e2e.labels(route).observe(total_s)

    def call_refused(self, route: str, status: int) -> None:
        """A call answered with an error before it reached the engine."""
        self.calls.labels(route or "unknown", str(status)).inc()

    def tokens_arrived(self, gap_s: float, count: int) -> None:
        """``count`` tokens of one sequence arrived ``gap_s`` seconds after its previous
        ones: ``count`` gaps of ``gap_s / count`` each."""
        if count <= 0:
            return
        each = gap_s / count
        for _ in range(count):
            self.itl.observe(each)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        return generate_latest(self.registry)
