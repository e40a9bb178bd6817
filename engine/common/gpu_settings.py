"""The settings only a GPU's plan uses, named as the user gave them: torch-free, so the
service can say so before a worker starts (``headroom plan``, ``serve``, ``bench
engine`` on the CPU)."""

from __future__ import annotations

from engine.common.units import fmt_bytes


def gpu_only_settings(cpu_layers: str, device_limit: int | None) -> tuple[str, ...]:
    """Of ``--cpu-layers`` and ``--device-limit`` (bytes), those given, as flags: on the
    CPU every layer already runs on the CPU and host memory has no limit to plan within,
    so they have no effect there."""
    given = []
    if cpu_layers not in ("auto", "0"):
        given.append(f"--cpu-layers {cpu_layers}")
    if device_limit is not None:
        given.append(f"--device-limit {fmt_bytes(device_limit)}")
    return tuple(given)
