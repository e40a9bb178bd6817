"""The expert cache's counters: what the offloaded layers of one engine did with their
experts since start, for the stats and ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExpertCounters:
    """Per-engine totals since start, in expert-steps unless said (one expert used by one
    step). ``misses == copies + cpu_runs + bus_reads``; the bus-read steps' hits and
    misses are counted at each refresh."""

    hits: int = 0  # served from the cache
    misses: int = 0  # not in it
    copies: int = 0  # experts copied in for a step, streamed ones included
    # copies into a slot already used in the same step: the waves of a step that routes
    # to more experts than the cache holds, and the experts a long prefill chunk stages
    # (engine.layers.moe.staged_prefill)
    streamed: int = 0
    cpu_runs: int = 0  # run on the CPU
    bus_reads: int = 0  # read from host memory over the bus by a decode step
    swaps: int = 0  # experts copied in by the hot-set refresh
    evictions: int = 0  # experts dropped from the cache

    @property
    def hit_rate(self) -> float:
        seen = self.hits + self.misses
        return self.hits / seen if seen else 0.0
