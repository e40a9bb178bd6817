"""What one chaos run does (:mod:`service.bench.chaos`): the requests and clients, the
worker kills and injected out-of-memory errors, the service it starts or the one it
plays against (:mod:`service.bench.chaos_service`), and the simulated desktop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChaosOptions:
    """One chaos run. ``url`` None: start a service (``model``, ``device``, extra
    ``serve_args``). ``requests`` sent by ``clients`` threads; ``kills`` SIGKILLs of
    the worker; ``ooms`` one-shot injected OOMs (needs ``faults_dir`` with ``url``);
    ``max_tokens`` per greedy request; ``hang_s``: a request with no ending after
    this many seconds counts as hung. ``vram_timeline``: the simulated desktop (None: a
    generated loop); ``hog_gib``: instead, a real second process on the GPU taking up
    to this many GiB (the service then reads NVML). ``seed`` fixes the mix and timing
    points. ``workdir``: logs, token, fault folder (None: a new temporary folder)."""

    requests: int = 1000
    clients: int = 16
    kills: int = 10
    ooms: int = 50
    url: str | None = None
    model: str | None = None
    device: str = "auto"
    max_tokens: int = 24
    hang_s: float = 600.0
    vram_timeline: Path | None = None
    device_total: str = "4GiB"
    hog_gib: float | None = None
    seed: int = 0
    faults_dir: Path | None = None
    token: str | None = None
    workdir: Path | None = None
    serve_args: tuple[str, ...] = ()
