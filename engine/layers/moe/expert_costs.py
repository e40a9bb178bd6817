"""What serving a missing expert costs, copying it to the device or running it on the
CPU: the :class:`CostModel` an expert cache decides by, measured on the machine
(:func:`measure_stack_costs`) or fixed one way (:data:`ALWAYS_COPY`, :data:`ALWAYS_CPU`),
and one expert's MLP as both tiers run it."""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.moe.expert_stacks import DenseStack, ExpertStack
from kernels.activation.reference import silu_and_mul


@dataclass(frozen=True)
class CostModel:
    """Seconds to bring one expert in versus to run it on the CPU.

    ``copy_bytes_per_s``: host -> device bandwidth; ``expert_bytes``: one expert's
    bytes as the tiers hold it (``[2I, H] + [H, I]`` dense, or its blocks); ``cpu_s_base`` and ``cpu_s_per_token``: a CPU run of one
    expert on ``n`` tokens takes ``cpu_s_base + n * cpu_s_per_token`` (measured by
    :func:`measure_costs` on 1 and 256 tokens; linear between). A run of a few
    tokens reads the weights and barely computes, so a slope taken below a few dozen
    tokens says nothing of a prefill chunk's hundreds, which are compute-bound.
    """

    copy_bytes_per_s: float
    expert_bytes: int
    cpu_s_base: float
    cpu_s_per_token: float

    def copy_s(self) -> float:
        return self.expert_bytes / self.copy_bytes_per_s

    def cpu_s(self, tokens: int) -> float:
        return self.cpu_s_base + tokens * self.cpu_s_per_token

    def prefers_copy(self, tokens: int, reuse: float = 0.0) -> bool:
        """Copy the expert in (True) or run it on the CPU (False) for ``tokens`` tokens,
        crediting the copy with ``reuse`` later one-token steps it is expected to serve
        from the cache (each saving a CPU run)."""
        return self.copy_s() <= self.cpu_s(tokens) + reuse * self.cpu_s(1)


ALWAYS_COPY = CostModel(copy_bytes_per_s=float("inf"), expert_bytes=0, cpu_s_base=1.0, cpu_s_per_token=0.0)


ALWAYS_CPU = CostModel(copy_bytes_per_s=1.0, expert_bytes=1, cpu_s_base=0.0, cpu_s_per_token=0.0)


def expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on ``x`` ``[T, H]``: ``silu(x W_gate^T) * (x W_up^T)`` through
    ``w_gate_up`` ``[2I, H]``, then ``w_down`` ``[H, I]``."""
    return F.linear(silu_and_mul(F.linear(x, w_gate_up)), w_down)


def best_time(fn, repeats: int) -> float:
    """The shortest of ``repeats`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_costs(host_gate_up: torch.Tensor, host_down: torch.Tensor, device: torch.device, repeats: int = 3) -> CostModel:
    """:func:`measure_stack_costs` of dense experts ``host_gate_up`` ``[E, 2I, H]``,
    ``host_down`` ``[E, H, I]``."""
    return measure_stack_costs(DenseStack(host_gate_up, host_down), device, repeats)


def measure_stack_costs(host: ExpertStack, device: torch.device, repeats: int = 3,
                        cpu_kernels: ctypes.CDLL | None = None) -> CostModel:
    """Time expert copies of ``host`` (a host tier) to ``device`` and one expert's CPU
    run on 1 and 256 tokens (best of ``repeats``), as :class:`OffloadedExperts` makes
    them: the copy moves the stack's own bytes (a GGUF's blocks); the CPU run is the C
    kernels' over the blocks (:mod:`kernels.cpu.moe_experts`) where ``cpu_kernels`` is
    given, else torch's on the dequantized weights (dequantizing included).

    The copy is timed from pinned memory (on CUDA), up to 4 experts back to back, so
    the figure is the bus's rate rather than one copy's launch and wait (a single
    pageable copy measured 10-15 GB/s on a link that streams 46).
    """
    n = min(4, host.num_experts)
    src = host.head(n).on_host(pin=device.type == "cuda")
    dst = src.empty(n, device)
    nbytes = src.expert_bytes

    def best(fn) -> float:
        return best_time(fn, repeats)

    def copy() -> None:
        for i in range(n):
            dst.copy_in(i, src, i, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    copy()  # first touch
    copy_s = max(best(copy) / n, 1e-9)
    hidden = src.weights_of(0, src.cpu_dtype)[0].shape[1]
    xs = {t: torch.randn(t, hidden, dtype=src.cpu_dtype) for t in (1, 256)}
    if cpu_kernels is not None:
        from kernels.cpu.moe_experts import moe_experts

        def run(t: int) -> None:
            pairs = torch.arange(t)
            moe_experts(cpu_kernels, xs[t], pairs, torch.zeros(t, dtype=torch.int64), torch.ones(t),
                        src.gate, src.up, src.down, src.types)

        run(1)  # first touch: the threads start, the blocks come into the caches' reach
        cpu = {t: best(lambda t=t: run(t)) for t in xs}
    else:
        cpu = {t: best(lambda t=t: expert_mlp(xs[t], *src.weights_of(0, xs[t].dtype))) for t in xs}
    per_token = max((cpu[256] - cpu[1]) / 255, 0.0)
    return CostModel(nbytes / copy_s, nbytes, max(cpu[1] - per_token, 0.0), per_token)
