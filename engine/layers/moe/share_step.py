"""A host layer's decode step with its CPU share (:mod:`engine.layers.moe.cpu_share`):
the fused kernel on the bus-read and cached experts, and beside it the C job
(:mod:`kernels.cpu.moe_job`) on the experts the lut gives the CPU, their sums added.

On CUDA, with no host round trip, so a decode CUDA graph holds it whole: after the
router, a side stream forks from the layer's stream and copies the step's hidden rows,
routed ids and weights, the live rows' flags (:class:`~engine.layers.moe.bus_reads.LiveRows`:
a graph's padding rows cost the CPU nothing) and the layer's lut into the job's pinned
buffers, queues ``moe_cpu_job`` as a host function (:mod:`kernels.cuda_host_fn`; a host
node in a capture) and copies the sums back to the device; meanwhile the layer's stream
runs the fused kernel, which skips the CPU's experts; the layer's stream then waits for
the side stream and adds the sums. The lut the job reads is the device's, copied in
stream order, so the kernel and the job always agree on who runs what, whatever the host
changes between steps. On the CPU device (tests) the same job runs in the calling thread.

On CUDA the job takes one core fewer than the process may use (:func:`job_threads`):
while it runs, the worker's own thread launches the next layers' work and then waits on
the stream, spinning; a job over every core would share one with it, and its work being
split evenly between its threads, every layer would wait for that core's thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.layers.moe.bus_reads import BUS_COUNTED_TOKENS, LiveRows
from engine.layers.moe.cpu_share import ShareRates, measure_bus_s, measure_cpu_rates
from engine.layers.moe.expert_costs import CostModel, best_time
from engine.layers.moe.expert_stacks import BlockStack
from kernels.cpu.moe_job import JobWindow, MoeCpuJob
from kernels.cpu.threads import default_threads


def job_threads(device: torch.device) -> int:
    """The C job's OpenMP threads on ``device`` (module docstring): on CUDA one fewer
    than :func:`~kernels.cpu.threads.default_threads` where that leaves two or more,
    elsewhere (the job runs in the calling thread) all of them."""
    threads = default_threads()
    return threads - 1 if torch.device(device).type == "cuda" and threads > 2 else threads


class ShareStep:
    """One host layer's CPU half of its decode steps (module docstring): steps of up to
    :data:`~engine.layers.moe.bus_reads.BUS_COUNTED_TOKENS` rows.

    Args:
        host: the layer's host tier (blocks; pinned on CUDA).
        lib: the C kernels (:func:`kernels.cpu.build.load`).
        device: the step's device.
        threads: the job's OpenMP threads (None: :func:`job_threads`).
    """

    def __init__(self, host: BlockStack, lib: ctypes.CDLL, device: torch.device, threads: int | None = None) -> None:
        self.host, self.lib, self.device = host, lib, torch.device(device)
        self.threads = threads or job_threads(self.device)
        self._taken = JobWindow()  # the job's totals at the last take_totals
        self.job: MoeCpuJob | None = None  # made at the first step (its K and dtypes)
        self._stream: torch.cuda.Stream | None = None
        self._sums: torch.Tensor | None = None  # the device's copy of the job's sums

    def _job_for(self, x: torch.Tensor, topk_weights: torch.Tensor, top_k: int) -> MoeCpuJob:
        job = self.job
        if job is None or (job.top_k, job.x_dtype, job.w_dtype) != (top_k, x.dtype, topk_weights.dtype):
            job = self.job = MoeCpuJob(self.lib, self.host.gate, self.host.up, self.host.down, self.host.types,
                                       BUS_COUNTED_TOKENS, top_k, x.dtype, topk_weights.dtype, self.threads,
                                       pin=self.device.type == "cuda")
            self._taken = JobWindow()  # a new job's totals start at zero
            if self.device.type == "cuda":
                self._stream = self._stream or torch.cuda.Stream(self.device)
                self._sums = torch.zeros(BUS_COUNTED_TOKENS, x.shape[1], dtype=torch.float32, device=self.device)
        return job

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, lut: torch.Tensor,
                live: LiveRows, fused: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fused()`` (the fused kernel over ``lut``, which skips the CPU's experts) plus
        the job's sums over the pairs ``lut`` gives the CPU: ``[T, H]`` in ``x``'s dtype.
        ``x`` ``[T, H]``, ``T <= BUS_COUNTED_TOKENS``; ``topk_*`` ``[T, K]``; ``lut`` int64 ``[E]``.

        Raises:
            ValueError: more rows than a decode step's.
            RuntimeError: on the CPU device, the job refused (on CUDA, :meth:`check` says so
                later).
        """
        rows = x.shape[0]
        if not 1 <= rows <= BUS_COUNTED_TOKENS:
            raise ValueError(f"a CPU share runs decode steps of 1..{BUS_COUNTED_TOKENS} rows, not {rows}")
        job = self._job_for(x, topk_weights, topk_ids.shape[1])
        if not x.is_cuda:
            job.load(x, topk_ids, topk_weights, lut, live.weights)
            sums = job.run(rows)
            return fused() + sums.to(x.dtype)
        main, side = torch.cuda.current_stream(x.device), self._stream
        side.wait_stream(main)  # the router's outputs are written
        with torch.cuda.stream(side):
            job.load(x, topk_ids, topk_weights, lut, live.weights, non_blocking=True)
            self._launch(side, rows)
            self._sums[:rows].copy_(job.out[:rows], non_blocking=True)
        out = fused()
        main.wait_stream(side)
        return out + self._sums[:rows].to(out.dtype)

    def _launch(self, stream: torch.cuda.Stream, rows: int) -> None:
        from kernels.cuda_host_fn import launch_host_func

        launch_host_func(stream, self.job.entry, self.job.pointer(rows))

    def check(self) -> None:
        """Between steps: raise if a run of the job refused (its sums were left zeros).

        Raises:
            RuntimeError: the status of the run, in words.
        """
        refused = self.job.refused() if self.job is not None else None
        if refused is not None:
            raise RuntimeError(f"the CPU share's job refused a step of {refused}")

    def take_totals(self) -> JobWindow:
        """Between steps: what the job took since the last call
        (:meth:`kernels.cpu.moe_job.MoeCpuJob.window`'s differences; zeros before a job)."""
        if self.job is None:
            return JobWindow()
        now = self.job.window()
        window, self._taken = now - self._taken, now
        return window

    def round_trip_s(self, top_k: int, repeats: int = 3) -> float:
        """Seconds a one-row step's CPU half takes with no CPU expert (CUDA: the copies
        and the host function on the side stream, waited for): the share's fixed cost."""
        x = torch.zeros(1, self.host.down.shape[1], dtype=torch.bfloat16, device=self.device)
        ids = torch.zeros(1, top_k, dtype=torch.int64, device=self.device)
        weights = torch.zeros(1, top_k, dtype=torch.bfloat16, device=self.device)
        lut = torch.full((self.host.num_experts,), -1, dtype=torch.int64, device=self.device)
        live = LiveRows(self.device)

        def run() -> None:
            self.forward(x, weights, ids, lut, live, lambda: torch.zeros_like(x))
            torch.cuda.synchronize(self.device)

        run()
        return best_time(run, repeats)


def measure_share_rates(host: BlockStack, device: torch.device, lib: ctypes.CDLL, costs: CostModel,
                        top_k: int = 8, repeats: int = 3) -> ShareRates:
    """:class:`~engine.layers.moe.cpu_share.ShareRates` for ``host``'s layer: the CPU's by
    :func:`~engine.layers.moe.cpu_share.measure_cpu_rates` (the job's threads as a step's); on CUDA the bus's by
    :func:`~engine.layers.moe.cpu_share.measure_bus_s` and the fixed cost plus the side
    stream's round trip (:meth:`ShareStep.round_trip_s`); elsewhere the bus's by
    ``costs``' copy rate (one expert's bytes at the host -> device bandwidth)."""
    cpu_s, fixed_s = measure_cpu_rates(host, lib, repeats, threads=job_threads(device))
    if device.type != "cuda":
        return ShareRates(bus_s=costs.copy_s(), cpu_s=cpu_s, cpu_fixed_s=fixed_s, job_fixed_s=fixed_s)
    trip = ShareStep(host, lib, device).round_trip_s(top_k, repeats)
    return ShareRates(bus_s=measure_bus_s(host, device, repeats), cpu_s=cpu_s, cpu_fixed_s=fixed_s + trip,
                      job_fixed_s=fixed_s)
