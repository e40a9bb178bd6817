"""``--request-timeout`` on the supervisor's ready clock
(:meth:`service.supervision.readiness.Readiness.ready_clock`), which stands still while
no worker is ready: a model load a request woke or waited for, or a worker restart
under it (its sequences sent again to the next worker), is not the request's time, as
with Ollama, whose load does not count against a request either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from service.api.engine_errors import timed_out

Event = TypeVar("Event")


def request_deadline(ready_clock: Callable[[], float], timeout_s: float, started: float) -> float | None:
    """The ready-clock reading past which a request that arrived at ``started``
    (``time.perf_counter()``) has run ``timeout_s`` seconds, or None (``timeout_s`` 0:
    no timeout). Read before the request waits for a load: the seconds since its
    arrival (reading its body) count as ready time."""
    if timeout_s <= 0:
        return None
    return ready_clock() - (time.perf_counter() - started) + timeout_s


async def get_before(
    queue: asyncio.Queue[Event], deadline: float | None, ready_clock: Callable[[], float]
) -> Event:
    """The next item of ``queue``, waiting until ``ready_clock()`` passes ``deadline``
    (None: no limit). A wait that ends while the clock stood still (a restart) is taken
    up again with what is left.

    Raises:
        APIError: 504 ``request_timeout`` past ``deadline``.
    """
    if deadline is None:
        return await queue.get()
    while True:
        left = deadline - ready_clock()
        if left <= 0:
            raise timed_out()
        try:
            return await asyncio.wait_for(queue.get(), left)
        except TimeoutError:
            continue
