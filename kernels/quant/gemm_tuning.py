"""The block GEMM's tiling (:func:`kernels.quant.triton_kernel.quant_gemm`), picked per
shape by timing: which tile of weight rows, how many weights of K a step decodes, how
many warps and pipeline stages run fastest depends on the format, N, K and the rows per
tile, and on the card. The first call of a shape outside a CUDA graph capture times each
of :data:`GEMM_TILINGS` (a few launches each, with CUDA events; no cache-flush buffer,
so a small card's memory plan is not crossed) and keeps the fastest for the process;
inside a capture, or off CUDA, the default runs. A decode graph's sizes are warmed up
eagerly before they are captured (:mod:`engine.core.cuda_graphs`), so their shapes are
timed there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triton.runtime.errors import OutOfResources

from kernels.quant.triton_decode import INTERPRETING

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GemmTiling:
    """One tiling of the block GEMM: ``block_n`` weight rows a program, ``k_step``
    weights of K decoded and multiplied a step (a power of two >= 16; the int8 GEMM
    takes them in groups of 32), Triton's ``num_warps`` and ``num_stages``, and
    ``int8``: the int8 tensor-core GEMM (:mod:`kernels.quant.triton_int8_gemm`) rather
    than the float one; ``packed``: the packed GEMM
    (:mod:`kernels.quant.triton_packed_gemm`, which takes its format's K step)."""

    block_n: int = 64
    k_step: int = 256
    num_warps: int = 4
    num_stages: int = 2
    int8: bool = False
    packed: bool = False


DEFAULT_TILING = GemmTiling(64, 128, 4, 3)
# None spills registers on sm_90 for any kept format at 16, 32 or 64 rows a tile (the
# compile check, tests/triton_quant_compile_check.py); wider ones (128 x 256, or 64 x 256
# in 4 warps) did at 32 rows, and 64 x 64 in 4 warps and 4 stages for Q5_K.
GEMM_TILINGS: tuple[GemmTiling, ...] = (
    DEFAULT_TILING,
    GemmTiling(64, 256, 8, 2),
    GemmTiling(32, 256, 4, 2),
    GemmTiling(128, 128, 8, 3),
    GemmTiling(32, 128, 4, 3),
)
# The int8 GEMM's (``quant_gemm_int8``): one or two groups of 32 a step (each group an
# int32 product and a float32 rescale of the tile; more unrolled groups, or 128-row
# tiles of Q6_K planes, spilled on sm_90).
INT8_TILINGS: tuple[GemmTiling, ...] = (
    GemmTiling(64, 32, 4, 3, True),
    GemmTiling(32, 32, 4, 3, True),
    GemmTiling(64, 64, 8, 3, True),
)
# The packed GEMM's (``quant_gemm_packed``, its PACKED_TYPES: kernels.quant.triton_packed_gemm),
# whose K step is its format's (``k_step`` unused); on an H200 the 64-row tiles of 16 rows
# and the 128-row tiles of 64 were the fastest (engine.bench.quant --gemm-sweep).
PACKED_TILINGS: tuple[GemmTiling, ...] = (
    GemmTiling(64, 256, 4, 2, packed=True),
    GemmTiling(64, 256, 4, 3, packed=True),
    GemmTiling(128, 256, 4, 2, packed=True),
    GemmTiling(128, 256, 8, 2, packed=True),
)
# The tilings each GEMM family times, by the name `tuned` takes.
FAMILIES = {"float": GEMM_TILINGS, "int8": INT8_TILINGS, "packed": PACKED_TILINGS}
# Float32 rows multiply in IEEE float32 (tests, exact references): a float32 operand tile
# takes twice a bfloat16 one's registers, so one sub-block a step.
IEEE_TILING = GemmTiling(64, 32, 8, 2)
_TIMED_RUNS = 5
_best: dict[tuple, GemmTiling] = {}


def tuned(block_m: int, n: int, k: int, type_name: str, device: torch.device,
          run: Callable[[GemmTiling], object], family: str = "float") -> GemmTiling:
    """The tiling for a ``block_m``-row tile of an ``[N, K]`` weight in ``type_name``
    blocks on ``device``: the fastest of ``family``'s tilings (``"float"``:
    :data:`GEMM_TILINGS`, ``"int8"``: :data:`INT8_TILINGS`, ``"packed"``:
    :data:`PACKED_TILINGS`) as ``run(tiling)`` (one GEMM) timed at the first call outside
    a capture, the first of them before that and off CUDA. A tiling that does not fit
    the SM (shared memory) is skipped."""
    candidates = FAMILIES[family]
    if device.type != "cuda" or INTERPRETING:
        return candidates[0]
    key = (block_m, n, k, type_name, device.index, family)
    best = _best.get(key)
    if best is not None:
        return best
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]
    times = {}
    for tiling in candidates:
        try:
            run(tiling)  # compile and warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(_TIMED_RUNS):
                run(tiling)
            end.record()
            end.synchronize()
            times[tiling] = start.elapsed_time(end) / _TIMED_RUNS
        except OutOfResources:
            continue
    best = min(times, key=times.get) if times else candidates[0]
    log.debug("block GEMM %s [%d, %d] x %d rows: %s (%.1f us)", type_name, n, k, block_m, best,
              1000 * times.get(best, float("nan")))
    _best[key] = best
    return best
