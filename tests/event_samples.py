"""Events as the hub publishes them, for the hub's and the schema's tests
(``test_events.py``, ``test_event_schema.py``).
"""

from __future__ import annotations

from engine.common.units import GiB
from service.events.schemas import HealthEvent, VramEvent


def vram(free: int, *, ours: int = 2 * GiB, reserve: int = GiB, total: int = 16 * GiB) -> VramEvent:
    return VramEvent(
        device="sim",
        source="simulated",
        total_bytes=total,
        free_bytes=free,
        ours_bytes=ours,
        others_bytes=total - free - ours,
        reserve_bytes=reserve,
        headroom_bytes=free - reserve,
    )


def health(status: str = "ready") -> HealthEvent:
    return HealthEvent(status=status, model="m")  # type: ignore[arg-type]
