"""One offloaded MoE layer's CPU half of a decode step as a C job (``moe_job.c``): its
host buffers and the ``moe_cpu_job`` entry, which finds the step's CPU pairs itself.

:class:`MoeCpuJob` holds, for up to ``max_rows`` rows, the host buffers a step's device
tensors are copied into (pinned where the device is CUDA: hidden rows ``x`` ``[T, H]``,
routed ``ids`` and router ``weights`` ``[T, K]``, the rows' ``live`` flags ``[T]``, the
layer's ``lut`` ``[E]``), the sums ``out`` ``[T, H]`` float32 the job writes, its work
bytes, and one C struct per row count (a CUDA graph captures one row count and keeps a
pointer to that struct). ``moe_cpu_job(struct *)`` reads the lut: the pairs whose
expert has :data:`CPU_RUN` there run on the cores by ``hr_moe_experts``
(:mod:`kernels.cpu.moe_experts`), every other pair is the GPU's; rows whose live flag is
0 cost nothing. :meth:`MoeCpuJob.run` calls it in this thread (the CPU device, tests);
on CUDA the engine queues :meth:`MoeCpuJob.pointer`'s struct with :attr:`MoeCpuJob.entry`
as a host function (:mod:`kernels.cuda_host_fn`).

The sums are :func:`kernels.cpu.moe_experts.moe_experts`'s over the same pairs, bit for
bit: the same pairs in the same order (row-major, grouped by expert, ascending).
"""

from __future__ import annotations

import ctypes
from dataclasses import astuple, dataclass

import torch

from kernels.cpu.block_gemv import GEMV_TYPE_IDS, gemv_path
from kernels.moe.quant_reference import SKIP_SLOT

# The lut's code for an expert whose pairs the CPU runs: the one the fused kernel skips
# (-1 is an expert read over the bus, 0.. a cache slot). moe_job.c's HR_CPU_RUN.
CPU_RUN = SKIP_SLOT
# Dtype codes of x and weights, as moe_job.c names them.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# What a job's status means (moe_job.c).
STATUS = {-1: "hr_moe_experts refused the blocks' types or sizes", -2: "its work buffer is too small",
          -3: "a routed id outside the layer's experts", -4: "an unknown dtype code"}

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32


class JobStruct(ctypes.Structure):
    """``hr_moe_job`` of ``moe_job.c``, field for field."""

    _fields_ = [("x", _p), ("ids", _p), ("weights", _p), ("live", _p), ("lut", _p), ("out", _p), ("work", _p),
                ("gate", _p), ("up", _p), ("down", _p),
                ("T", _i64), ("H", _i64), ("I", _i64), ("K", _i64), ("E", _i64), ("work_bytes", _i64),
                ("x_dtype", _i32), ("w_dtype", _i32), ("tg", _i32), ("tu", _i32), ("td", _i32), ("threads", _i32),
                ("path", _i32), ("status", _i32), ("pairs", _i64),
                ("runs", _i64), ("busy_ns", _i64), ("pairs_run", _i64),
                ("paired_runs", _i64), ("paired_ns", _i64), ("pairs_sq", _i64), ("pair_ns", ctypes.c_double)]


@dataclass(frozen=True)
class JobWindow:
    """What a job's runs took, as running totals or a window's differences (``a - b``):
    ``runs`` calls, ``seconds`` of wall time inside them (the job's own timing), ``pairs``
    CPU pairs; and over the calls that ran a pair, the sums a least-squares line of a
    call's seconds against its pairs needs: ``paired_runs`` calls, ``paired_seconds``,
    ``pairs_sq`` (their pairs squared) and ``pair_seconds`` (pairs times seconds)."""

    runs: int = 0
    seconds: float = 0.0
    pairs: int = 0
    paired_runs: int = 0
    paired_seconds: float = 0.0
    pairs_sq: int = 0
    pair_seconds: float = 0.0

    def __sub__(self, other: JobWindow) -> JobWindow:
        return JobWindow(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def line(self) -> tuple[float, float] | None:
        """``(fixed seconds a call, seconds a pair)``: the least-squares line of the calls
        that ran a pair, their seconds against their pairs; None when fewer than two such
        calls, or all of the same pair count (no slope to fit)."""
        n, p, t = self.paired_runs, self.pairs, self.paired_seconds
        spread = n * self.pairs_sq - p * p
        if n < 2 or spread <= 0:
            return None
        slope = (n * self.pair_seconds - p * t) / spread
        return (t - slope * p) / n, slope


class MoeCpuJob:
    """A layer's job buffers and structs (module docstring).

    Args:
        lib: the library of :func:`kernels.cpu.build.load`.
        gate, up, down: the layer's blocks, uint8 ``[E, I, ...]``, ``[E, I, ...]``,
            ``[E, H, ...]``, contiguous, in host memory (kept alive here).
        types: their GGML type names (keys of :data:`~kernels.cpu.block_gemv.GEMV_TYPE_IDS`).
        max_rows, top_k: the most rows a step gives, and ``K``.
        x_dtype, w_dtype: the dtypes of the hidden rows and the router weights
            (float32, bfloat16 or float16).
        threads: OpenMP threads of a run.
        pin: pin the buffers (a CUDA device copies into them asynchronously).

    Raises:
        ValueError: a type without a C kernel, a dtype without a code, or blocks not in
            host memory.
    """

    def __init__(self, lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 types: tuple[str, str, str], max_rows: int, top_k: int, x_dtype: torch.dtype,
                 w_dtype: torch.dtype, threads: int, pin: bool) -> None:
        if not all(t in GEMV_TYPE_IDS for t in types):
            raise ValueError(f"CPU experts of types {'/'.join(types)}: the C kernels read {', '.join(GEMV_TYPE_IDS)}")
        for dt in (x_dtype, w_dtype):
            if dt not in DTYPE_CODES:
                raise ValueError(f"the CPU job takes float32, bfloat16 or float16 rows and weights, not {dt}")
        if any(b.device.type != "cpu" or not b.is_contiguous() for b in (gate, up, down)):
            raise ValueError("the CPU job reads the layer's blocks in host memory, contiguous")
        self.lib, self.blocks, self.types = lib, (gate, up, down), types
        num_experts, inter, hidden = gate.shape[0], gate.shape[1], down.shape[1]
        self.max_rows, self.top_k, self.num_experts, self.hidden, self.inter = max_rows, top_k, num_experts, hidden, inter
        self.x_dtype, self.w_dtype, self.threads = x_dtype, w_dtype, threads

        def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        self.x = buffer((max_rows, hidden), x_dtype)
        self.ids = buffer((max_rows, top_k), torch.int64)
        self.weights = buffer((max_rows, top_k), w_dtype)
        self.live = buffer((max_rows,), torch.float32)
        self.lut = buffer((num_experts,), torch.int64)
        self.out = buffer((max_rows, hidden), torch.float32)
        self.work = torch.empty(lib.hr_moe_job_work_bytes(max_rows, hidden, inter, top_k, num_experts),
                                dtype=torch.uint8)
        self._structs: dict[int, JobStruct] = {}

    @property
    def entry(self) -> int:
        """The address of ``moe_cpu_job`` (a CUDA host function's shape)."""
        return ctypes.cast(self.lib.moe_cpu_job, ctypes.c_void_p).value

    def pointer(self, rows: int) -> int:
        """The address of the struct for steps of ``rows`` rows (made once, kept while
        this job lives: a captured graph holds it).

        Raises:
            ValueError: ``rows`` outside ``1..max_rows``.
        """
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a CPU job takes 1..{self.max_rows} rows, not {rows}")
        if rows not in self._structs:
            codes = [GEMV_TYPE_IDS[t] for t in self.types]
            self._structs[rows] = JobStruct(
                self.x.data_ptr(), self.ids.data_ptr(), self.weights.data_ptr(), self.live.data_ptr(),
                self.lut.data_ptr(), self.out.data_ptr(), self.work.data_ptr(),
                *(b.data_ptr() for b in self.blocks), rows, self.hidden, self.inter, self.top_k, self.num_experts,
                self.work.numel(), DTYPE_CODES[self.x_dtype], DTYPE_CODES[self.w_dtype], *codes, self.threads,
                gemv_path(), 0, 0)
        return ctypes.addressof(self._structs[rows])

    def status(self, rows: int) -> tuple[int, int]:
        """``(status, pairs)`` of the last run for ``rows`` rows (0: done)."""
        s = self._structs[rows]
        return s.status, s.pairs

    def totals(self) -> tuple[int, float, int]:
        """``(runs, seconds, pairs)`` over every run of this job so far, every row count's
        struct together: the calls, their wall seconds inside ``moe_cpu_job`` (timed by the
        job itself, so on CUDA the runs inside the decode steps, not the host function's
        queueing), and the CPU pairs they ran. Running totals the C side alone writes:
        read them between steps and take differences."""
        structs = list(self._structs.values())
        return (sum(s.runs for s in structs), sum(s.busy_ns for s in structs) * 1e-9,
                sum(s.pairs_run for s in structs))

    def window(self) -> JobWindow:
        """:class:`JobWindow` of every run so far (every row count's struct together):
        running totals; take differences between steps."""
        structs = list(self._structs.values())
        return JobWindow(sum(s.runs for s in structs), sum(s.busy_ns for s in structs) * 1e-9,
                         sum(s.pairs_run for s in structs), sum(s.paired_runs for s in structs),
                         sum(s.paired_ns for s in structs) * 1e-9, sum(s.pairs_sq for s in structs),
                         sum(s.pair_ns for s in structs) * 1e-9)

    def refused(self) -> str | None:
        """What the last run of a row count refused, in words (its rows and status), or
        None when every struct's last run was done."""
        for rows, s in self._structs.items():
            if s.status != 0:
                return f"{rows} rows: {STATUS.get(s.status, s.status)}"
        return None

    def run(self, rows: int) -> torch.Tensor:
        """Run the job for the first ``rows`` rows of the buffers in this thread: the sums,
        float32 ``[rows, H]`` (a view of :attr:`out`).

        Raises:
            RuntimeError: the job refused (its status, in words).
        """
        at = self.pointer(rows)
        self.lib.moe_cpu_job(at)
        status, _ = self.status(rows)
        if status != 0:
            raise RuntimeError(f"moe_cpu_job: {STATUS.get(status, status)}")
        return self.out[:rows]

    def load(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lut: torch.Tensor,
             live: torch.Tensor | None = None, non_blocking: bool = False) -> int:
        """Copy a step's tensors into the buffers (in the current stream's order, from any
        device): ``x`` ``[T, H]``, ``topk_ids``/``topk_weights`` ``[T, K]``, ``lut``
        ``[E]``, ``live`` ``[T]`` (None: every row live). Returns ``T``.

        Raises:
            ValueError: more rows than ``max_rows``, or another width or ``K``.
        """
        rows = x.shape[0]
        if rows > self.max_rows or x.shape[1] != self.hidden or tuple(topk_ids.shape) != (rows, self.top_k):
            raise ValueError(f"a CPU job of [<= {self.max_rows}, {self.hidden}] rows and top-{self.top_k} got x "
                             f"{tuple(x.shape)} and ids {tuple(topk_ids.shape)}")
        self.x[:rows].copy_(x, non_blocking=non_blocking)
        self.ids[:rows].copy_(topk_ids, non_blocking=non_blocking)
        self.weights[:rows].copy_(topk_weights, non_blocking=non_blocking)
        self.lut.copy_(lut, non_blocking=non_blocking)
        if live is None:
            self.live[:rows].fill_(1.0)
        else:
            self.live[:rows].copy_(live[:rows], non_blocking=non_blocking)
        return rows
