"""Backpressure: a bounded count of API requests waiting for the engine.

A request *waits* from when it is admitted (its body decoded and checked) until the
engine sends its first output: while its prompt is tokenized, while it sits in the
engine's queue, and during its prefill. Past ``--max-queued-requests`` waiting
requests, a new one is answered 503 ``queue_full`` with ``Retry-After`` at once,
before its prompt is tokenized, so a burst costs neither memory nor CPU here. Requests
already decoding are bounded by the engine (``--max-running-requests``) and are not
counted. The count lives in the service's event loop (no lock needed).
"""

from __future__ import annotations

from service.common.errors import SERVER_ERROR, APIError

QUEUE_FULL = "queue_full"
# Seconds a refused client should wait: about one decode wave of a small model.
QUEUE_RETRY_AFTER_S = 1


class Ticket:
    """One admitted request's place in the count; :meth:`release` is idempotent."""

    __slots__ = ("_admission", "_held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.waiting -= 1


class Admission:
    """The waiting-request count.

    Args:
        limit: most waiting requests; 0 means no limit.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0

    def enter(self) -> Ticket:
        """Admit one request.

        Raises:
            APIError: 503 ``queue_full`` with ``Retry-After`` when ``limit`` requests
                already wait.
        """
        if self.limit and self.waiting >= self.limit:
            raise APIError(
                503,
                f"{self.waiting} {'request is' if self.waiting == 1 else 'requests are'} "
                "already waiting for the engine (the limit, --max-queued-requests); retry later",
                type=SERVER_ERROR,
                code=QUEUE_FULL,
                headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)},
            )
        self.waiting += 1
        return Ticket(self)
