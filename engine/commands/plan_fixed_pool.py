"""``headroom plan --kv-cache SIZE`` or ``--num-pages N``: the ledger of a KV pool fixed
by a setting, as ``headroom serve`` runs it.

With either setting the engine fits no plan (:attr:`engine.core.plan_stages.PlanStages._planned`):
its pools are those :func:`engine.memory.fixed_pool.unplanned_pool` sizes: ``N`` pages
and the sliding-window rings' bound beside them (at most as many), or the KV pool's
pages and the ring pool that ``--kv-cache`` bytes hold together, split as the plan
splits a card's room; ``--cpu-layers auto`` and ``--cpu-experts auto`` run nothing on
the CPU. This prices those pools against the budget the device gives: the ledger at the
configured knobs with its KV lines (the pool, the rings) replaced, fitting when the two
are no larger than what the rest leaves.
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
from engine.memory.fixed_pool import fixed_setting, short_pool_warning, unplanned_pool
from engine.memory.kv_fit import RING_FLOOR_REQUESTS, RingPrice, kv_pages, usable_pages
from engine.memory.plan import LedgerEntry, MemoryPlan, PlanKnobs, Suggestion

POOL_LINE = "KV cache pool"
RING_LINE = "sliding-window KV rings"


@dataclass(frozen=True)
class FixedPool:
    """A KV pool fixed by a setting, beside the plan it replaces.

    Attributes:
        setting: the setting as given, e.g. ``"--kv-cache 2.00 GiB"``, ``"--num-pages 512"``.
        planned_pages: usable pages the memory plan would give without it.
        planned_context: the context (tokens) one request would get then.
        room_bytes: what the budget leaves for the KV pool's and the ring pool's usable
            pages beside everything else.
        page_bytes: one page of the pool on the device, in bytes.
        warning: ``--num-pages`` holding less than one ``--min-context``, in words
            (:func:`engine.memory.fixed_pool.short_pool_warning`), else None.
        ring_bytes: the ring pool's usable pages beside the KV pool, in bytes (0 without a ring).
        ring: the ring pool's price, None without a ring.
        planned_bytes: the KV and ring pools' usable pages the memory plan would give,
            in bytes.
    """

    setting: str
    planned_pages: int
    planned_context: int
    room_bytes: int
    page_bytes: int
    warning: str | None = None
    ring_bytes: int = 0
    ring: RingPrice | None = None
    planned_bytes: int = 0

    def message(self, plan: MemoryPlan) -> str:
        """What does not fit and what fixes it (the fixed pool's :meth:`MemoryPlan.message`)."""
        both = plan.kv_pool_bytes + self.ring_bytes
        short = both - self.room_bytes
        what = f"a KV pool of {fmt_bytes(plan.kv_pool_bytes)}" if self.ring is None else (
            f"a KV cache of {fmt_bytes(both)} (a KV pool of {fmt_bytes(plan.kv_pool_bytes)} and sliding-window rings "
            f"of {fmt_bytes(self.ring_bytes)})")
        lines = [
            f"the memory plan does not fit on {plan.device}: {self.setting} is {what}, {fmt_bytes(short)} more than "
            f"the budget of {fmt_bytes(plan.budget_bytes)} leaves for it ({fmt_bytes(max(self.room_bytes, 0))}).",
            "Any one of these settings fixes it:",
        ]
        for s in self.suggestions(plan):
            lines.append(f"  {s.flag} unset: {s.price}" if s.proposed == "unset" else
                         f"  {s.flag} {s.current} → {s.proposed}" + (f" ({s.price})" if s.price else ""))
        return "\n".join(lines)

    def suggestions(self, plan: MemoryPlan) -> list[Suggestion]:
        """The settings that make ``plan`` (this pool's) fit, as ``plan --json`` and the
        text name them: the setting lowered to what the budget leaves (``current`` and
        ``proposed`` as the text writes them), and the setting unset."""
        both = plan.kv_pool_bytes + self.ring_bytes
        room = max(self.room_bytes, 0)
        flag, _, current = self.setting.partition(" ")
        found = []
        # Usable KV pages that fit, with the rings --num-pages sets beside them.
        most = kv_pages(room, self.page_bytes, *((self.ring.page_bytes, self.ring.full_cap) if self.ring else ()))
        if flag == "--num-pages" and most >= 1:
            found.append(Suggestion(flag, current, str(most + 1), both - room, "the null page included"))
        elif flag != "--num-pages" and room >= MiB:
            found.append(Suggestion(flag, current, f"{room // MiB} MiB", both - room))
        found.append(Suggestion(flag, current, "unset", both - self.planned_bytes, (
            f"the plan sizes the pool ({self.planned_pages} pages, a context of {self.planned_context:,} tokens)")))
        return found


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
            ``--min-context`` (:func:`engine.memory.fixed_pool.unplanned_pool`).
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
    price = ring.price(kv_ring_page_bytes(mc, kv_dtype, ring), knobs.max_running_requests,
                       knobs.state_checkpoints) if ring is not None else None
    # The engine counts pages over every layer (engine.core.plan_stages._num_pages); a
    # device page holds the layers the device runs (the plan's per-token figure).
    size = unplanned_pool(config, mc, kv_bytes_per_token(mc, kv_dtype, ring) * config.page_size, price)
    pages = usable_pages(size.pages)
    page_bytes = plan.kv_bytes_per_token * config.page_size
    ledger = list(plan.ledger)
    # Everything but the two pools' usable pages (the ring pool's null page is among it).
    fixed = plan.fixed_bytes - plan.kv_ring_pages * (price.page_bytes if price is not None else 0)
    ring_bytes = 0
    if price is not None:
        ring_bytes = size.rings * price.page_bytes
        ledger = [_with(e, ring_bytes + price.page_bytes, f"exact, {size.rings} pages of {fmt_bytes(price.page_bytes)} "
                        f"following the {pages} pages of the fixed KV pool ({_rings_rule(config)}) and the null page")
                  if e.name == RING_LINE else e for e in ledger]
    kv_bytes = pages * page_bytes
    ledger = [_with(e, kv_bytes, f"{pages} pages of {fmt_bytes(page_bytes)}, fixed by {setting} (the plan would "
                    f"give {planned.num_pages})" + (f", {plan.kv_cache_dtype}" if plan.kv_cache_dtype else ""))
              if e.name == POOL_LINE else e for e in ledger]
    room = plan.budget_bytes - fixed
    fits = kv_bytes + ring_bytes <= room
    context = min(plan.wanted_context_tokens, pages * config.page_size)
    note = "" if context >= plan.wanted_context_tokens else (
        f"context {plan.wanted_context_tokens:,} -> {context:,} tokens: the KV pool fixed by {setting}")
    out = msgspec.structs.replace(
        plan, ledger=ledger, fixed_bytes=fixed + ring_bytes, kv_pool_bytes=kv_bytes, num_pages=pages,
        kv_ring_pages=size.rings, max_context_tokens=context, fits=fits,
        shortfall_bytes=0 if fits else kv_bytes + ring_bytes - room, suggestions=[], context_note=note)
    planned_bytes = planned.kv_pool_bytes + planned.kv_ring_pages * (price.page_bytes if price is not None else 0)
    pool = FixedPool(setting, planned.num_pages, planned.max_context_tokens, room, page_bytes,
                     short_pool_warning(config, mc), ring_bytes, price, planned_bytes)
    return (out if fits else msgspec.structs.replace(out, suggestions=pool.suggestions(out))), pool


def _rings_rule(config: EngineConfig) -> str:
    """How the fixed setting sets the ring pool beside the KV pool, in words."""
    if config.num_pages is not None:
        return "the rings' bound, at most as many"
    return (f"{fixed_setting(config)} holds both pools, split as the plan splits a card's room: the rings' bound "
            "where it holds it beside the whole context, else the context first, then the rings, at least those of "
            f"{RING_FLOOR_REQUESTS} requests")


def _with(entry: LedgerEntry, size: int, source: str) -> LedgerEntry:
    return msgspec.structs.replace(entry, bytes=size, source=source)
