"""``headroom plan --kv-cache SIZE`` or ``--num-pages N``: the ledger of a KV pool fixed
by a setting, as ``headroom serve`` runs it.

With either setting the engine fits no plan (:attr:`engine.core.plan_stages.PlanStages._planned`):
its pool is ``N`` pages, or as many as ``--kv-cache`` bytes hold
(:func:`engine.memory.fixed_pool.unplanned_pages`), the null page included; its
sliding-window rings follow those pages with no plan's cap
(:meth:`engine.kvcache.ring.SlidingRing.pool_pages`); ``--cpu-layers auto`` and
``--cpu-experts auto`` run nothing on the CPU. This prices that pool against the budget
the device gives: the ledger at the configured knobs with its KV lines (the pool, the
rings) replaced, fitting when the pool is no larger than what the rest leaves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec
import torch

from engine.common.config import EngineConfig, ModelConfig
from engine.common.units import MiB, fmt_bytes
from engine.core.footprint import kv_bytes_per_token, kv_ring, kv_ring_page_bytes
from engine.kvcache.pool import kv_storage_dtype
from engine.memory.fixed_pool import fixed_setting, short_pool_warning, unplanned_pages
from engine.memory.plan import LedgerEntry, MemoryPlan, PlanKnobs

POOL_LINE = "KV cache pool"
RING_LINE = "sliding-window KV rings"


@dataclass(frozen=True)
class FixedPool:
    """A KV pool fixed by a setting, beside the plan it replaces.

    Attributes:
        setting: the setting as given, e.g. ``"--kv-cache 2.00 GiB"``, ``"--num-pages 512"``.
        planned_pages: usable pages the memory plan would give without it.
        planned_context: the context (tokens) one request would get then.
        room_bytes: what the budget leaves for the pool beside everything else.
        page_bytes: one page of the pool on the device, in bytes.
        warning: ``--num-pages`` holding less than one ``--min-context``, in words
            (:func:`engine.memory.fixed_pool.short_pool_warning`), else None.
    """

    setting: str
    planned_pages: int
    planned_context: int
    room_bytes: int
    page_bytes: int
    warning: str | None = None

    def message(self, plan: MemoryPlan) -> str:
        """What does not fit and what fixes it (the fixed pool's :meth:`MemoryPlan.message`)."""
        short = plan.kv_pool_bytes - self.room_bytes
        lines = [
            f"the memory plan does not fit on {plan.device}: {self.setting} is a KV pool of "
            f"{fmt_bytes(plan.kv_pool_bytes)}, {fmt_bytes(short)} more than the budget of "
            f"{fmt_bytes(plan.budget_bytes)} leaves for it ({fmt_bytes(max(self.room_bytes, 0))}).",
            "Any one of these settings fixes it:",
        ]
        most = max(self.room_bytes // self.page_bytes, 0)  # usable pages that fit
        if most >= 1:
            if self.setting.startswith("--num-pages"):
                lines.append(f"  {self.setting} → {most + 1} (the null page included)")
            else:
                lines.append(f"  {self.setting} → {(most + 1) * self.page_bytes // MiB} MiB")
        lines.append(f"  {self.setting.split()[0]} unset: the plan sizes the pool ({self.planned_pages} pages, "
                     f"a context of {self.planned_context:,} tokens)")
        return "\n".join(lines)


def with_fixed_pool(
    planner: Callable[[PlanKnobs], MemoryPlan],
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    planned: MemoryPlan,
) -> tuple[MemoryPlan, FixedPool]:
    """The plan of ``config``'s fixed KV pool (see the module docstring) and the
    :class:`FixedPool` that says what it replaced (``planned``: the plan without it).

    Raises:
        ValueError: ``config`` fixes no pool.
        engine.common.errors.SettingRefused: ``--kv-cache`` holds less than one
            ``--min-context`` (:func:`engine.memory.fixed_pool.unplanned_pages`).
    """
    setting = fixed_setting(config)
    if setting is None:
        raise ValueError("neither --num-pages nor --kv-cache is set: the plan sizes the pool")
    knobs = PlanKnobs.of(config)
    # No plan: nothing is fitted to run on the CPU (engine.core.weights_stage).
    knobs = replace(knobs, cpu_layers="0" if knobs.cpu_layers == "auto" else knobs.cpu_layers,
                    cpu_experts="0" if knobs.cpu_experts == "auto" else knobs.cpu_experts)
    plan = planner(knobs)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
    ring = kv_ring(mc, knobs)
    # The engine counts pages over every layer (engine.core.plan_stages._num_pages); a
    # device page holds the layers the device runs (the plan's per-token figure).
    total = config.num_pages or unplanned_pages(config, mc, kv_bytes_per_token(mc, kv_dtype, ring) * config.page_size)
    pages = total - 1  # less the null page
    page_bytes = plan.kv_bytes_per_token * config.page_size
    ledger = list(plan.ledger)
    fixed = plan.fixed_bytes
    rings = 0
    if ring is not None:
        ring_page = kv_ring_page_bytes(mc, kv_dtype, ring)
        rings = ring.pool_pages(knobs.max_running_requests, knobs.state_checkpoints, global_pages=pages) - 1
        fixed += (rings - plan.kv_ring_pages) * ring_page
        ledger = [_with(e, (rings + 1) * ring_page, f"exact, {rings} pages of {fmt_bytes(ring_page)} (following the "
                        f"{pages} pages of the fixed KV pool) and the null page") if e.name == RING_LINE else e
                  for e in ledger]
    kv_bytes = pages * page_bytes
    ledger = [_with(e, kv_bytes, f"{pages} pages of {fmt_bytes(page_bytes)}, fixed by {setting} (the plan would "
                    f"give {planned.num_pages})" + (f", {plan.kv_cache_dtype}" if plan.kv_cache_dtype else ""))
              if e.name == POOL_LINE else e for e in ledger]
    room = plan.budget_bytes - fixed
    fits = kv_bytes <= room
    context = min(plan.wanted_context_tokens, pages * config.page_size)
    note = "" if context >= plan.wanted_context_tokens else (
        f"context {plan.wanted_context_tokens:,} -> {context:,} tokens: the KV pool fixed by {setting}")
    out = msgspec.structs.replace(
        plan, ledger=ledger, fixed_bytes=fixed, kv_pool_bytes=kv_bytes, num_pages=pages, kv_ring_pages=rings,
        max_context_tokens=context, fits=fits, shortfall_bytes=0 if fits else kv_bytes - room, suggestions=[],
        context_note=note)
    return out, FixedPool(setting, planned.num_pages, planned.max_context_tokens, room, page_bytes,
                          short_pool_warning(config, mc))


def _with(entry: LedgerEntry, size: int, source: str) -> LedgerEntry:
    return msgspec.structs.replace(entry, bytes=size, source=source)
