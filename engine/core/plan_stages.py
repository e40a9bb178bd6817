"""The engine's memory-planning stages: whether a plan is made, the plan fitted to the
device (the prefill chunk lowered only when the floor context does not fit), the
profile run that measures a worst-case step, the decode graphs' capture and the CUDA
context's growth on a small pool, and the KV pool's size in pages from the plan.

:class:`PlanStages` is a part of :class:`engine.core.engine.Engine` (it uses the
engine's ``config``, ``model_config``, ``model``, ``device``, ``dtype``, ``kv_dtype``,
``knobs``, ``plan``, ``device_memory``, ``weight_size``, ``attention_backend``,
``expert_stores``, ``tp`` and ``vocab_size``), as the constructor calls them in order.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from engine.common.config import ModelConfig
from engine.common.errors import PlanDoesNotFit
from engine.common.units import fmt_bytes
from engine.core.cuda_graphs import DecodeGraphs
from engine.core.footprint import kv_bytes_per_token, kv_ring, kv_ring_page_bytes, make_footprint
from engine.core.prefill_graphs import PrefillGraphs, backend_plans_on_host
from engine.core.profile import measure_step_peak, profile_pool_pages
from engine.core.startup import attention_workspaces
from engine.kvcache.pool import KVPool
from engine.kvcache.ring import SlidingRing
from engine.layers.attention.registry import backend_class, model_attention
from engine.layers.moe.offload import before_forward, can_capture_decode
from engine.memory.fixed_pool import FixedPoolSize, short_pool_warning, unplanned_pool
from engine.memory.kv_fit import RingPrice, RingRule
from engine.memory.ledger import make_plan
from engine.memory.plan import MemoryPlan, PlanKnobs
from engine.memory.plan_fit import fit_model_plan

log = logging.getLogger("headroom.engine")


class PlanStages:
    """The engine's planning stages (see the module docstring)."""

    @property
    def _planned(self) -> bool:
        c = self.config
        return c.num_pages is None and c.kv_cache is None and (
            c.device_total is not None or self.device.type == "cuda"
        )


    def _workspaces(self) -> tuple[tuple[str, int], ...]:
        """Fixed workspaces declared by the components, charged before the pool is sized."""
        return attention_workspaces(self.attention_backend, self.model_config, self.knobs.max_running_requests)


    def _kv_pool(self, num_pages: int, ring_pages: int | None = None) -> KVPool:
        """A KV pool of ``num_pages`` pages (the null page included) for this model, in
        the engine's KV dtype on its device: the profile run's small one or the real one;
        its ring pool of ``ring_pages`` (None: :meth:`_ring_pool_pages`)."""
        mc = self.model_config
        ring = self._kv_ring
        if ring_pages is None:
            ring_pages = self._ring_pool_pages(num_pages)
        # --cpu-layers: the last layers' KV is in their host pool (engine.layers.host_layers).
        return KVPool(num_layers=mc.num_kv_layers - self.cpu_layers, num_pages=num_pages, page_size=self.config.page_size,
                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=self.kv_dtype, device=self.device,
                      compute_dtype=self.dtype, ring_layers=ring.layers if ring else (), ring_pages=ring_pages)

    def _ring_pool_pages(self, num_pages: int) -> int:
        """The ring pool's pages beside a KV pool of ``num_pages`` (null pages included):
        :meth:`engine.kvcache.ring.SlidingRing.pool_pages` under the plan's cap; 0
        without a ring."""
        ring = self._kv_ring
        return ring.pool_pages(self.knobs.max_running_requests, self.knobs.state_checkpoints,
                               global_pages=num_pages - 1, cap=self._ring_cap) if ring else 0

    # The pools sized without a plan (--kv-cache, --num-pages, the CPU's default), else None.
    _fixed_pool: FixedPoolSize | None = None

    @property
    def _ring_cap(self) -> int | None:
        """The ring pool's pages the memory plan chose (:mod:`engine.memory.kv_fit`), or
        the size that fixed the pool without a plan (:func:`engine.memory.fixed_pool.unplanned_pool`);
        None where neither sized one."""
        if self.plan is not None:
            return self.plan.kv_ring_pages or None
        return self._fixed_pool.rings or None if self._fixed_pool is not None else None

    @property
    def _ring_price(self) -> RingPrice | None:
        """The ring pool's price beside the KV pool at the knobs the plan fitted
        (:class:`engine.memory.kv_fit.RingPrice`), None without a ring."""
        ring, knobs = self._kv_ring, self.knobs
        if ring is None:
            return None
        return ring.price(kv_ring_page_bytes(self.model_config, self.kv_dtype, ring), knobs.max_running_requests,
                          knobs.state_checkpoints)

    def _ring_rule(self, pool: KVPool) -> RingRule | None:
        """The ring pool's size beside the KV pool as live replans resize it
        (:class:`engine.memory.kv_fit.RingRule`), from the start's ``pool``: the plan's
        bound, floor and wanted context (without a plan, those the size that fixed the
        pool split by; for ``--num-pages``, the rings' bound beside the pages, as at
        start); None without a ring."""
        ring = self._kv_ring
        if ring is None or not pool.ring_layers:
            return None
        knobs, plan = self.knobs, self.plan
        price = ring.price(pool.ring_page_bytes, knobs.max_running_requests, knobs.state_checkpoints)
        if plan is not None:
            wanted = -(-plan.wanted_context_tokens // knobs.page_size) if plan.kv_ring_pages else 0
        else:
            wanted = self._fixed_pool.wanted_pages if self._fixed_pool is not None else 0
        return RingRule(ring_page_bytes=price.page_bytes, full_cap=price.full_cap, floor_cap=price.floor_cap,
                        wanted_pages=wanted, planned_pages=pool.num_pages - 1, planned_rings=pool.ring_pages - 1)

    @property
    def _kv_ring(self) -> SlidingRing | None:
        """The ring in which the sliding-window layers keep only their window, at the
        knobs the plan fitted (:func:`engine.core.footprint.kv_ring`), else None."""
        return kv_ring(self.model_config, self.knobs)

    def _attention(self, pool: KVPool):
        mc = self.model_config
        return model_attention(self.attention_backend, pool, mc, self.knobs.max_running_requests)


    _graph_bytes_measured: int | None = None
    _prefill_capture_failed = False  # the plan's probe could not capture the prefill graphs


    @property
    def _use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: asked for (the default), on CUDA, and the
        backend's decode path can be captured (the torch backend's cannot: it builds its
        metadata on the host per step)."""
        # Hybrid linear-attention models too: their decode step gathers and scatters the
        # states at slots the graphs' inputs hold (engine.core.cuda_graphs). Not where a
        # layer's experts in host memory are placed on the host each
        # step (the routed ids read back): only where they are read over the bus. Under
        # tensor parallelism every rank can capture its graphs, the all-reduces inside (engine.core.tp_graphs), but that path has not yet run on
        # two GPUs: it stays opt-in (--tp-cuda-graphs) until it has, and the
        # group decodes eagerly as measured. gpt-oss's experts (biases, the clamped SwiGLU)
        # are in the Triton MoE's epilogues, so its decode is captured too.
        tp_ok = self.tp is None or self.config.tp_cuda_graphs
        # Nor with decoder layers on the CPU (--cpu-layers): a step reads the device's rows
        # back to the host mid-forward, so it decodes eagerly (logged at the split).
        return (self.config.cuda_graphs and self.device.type == "cuda" and self._cuda_graph_max_batch >= 1
                and not self.cpu_layers
                and can_capture_decode(self.expert_stores) and tp_ok
                and backend_class(self.attention_backend).supports_cuda_graphs)


    @property
    def _prefill_graph_tokens(self) -> int:
        """Largest one-sequence prefill chunk replayed from a CUDA graph, 0 for none
        (:mod:`engine.core.prefill_graphs`): with the decode graphs, for dense models on
        one GPU over a backend that plans nothing on the host; never above the configured
        chunk (the engine caps it again at the chunk the plan fitted)."""
        mc = self.model_config
        # Nor models with sliding-window layers: on an H100 (2026-12-06) Gemma 3's prefill
        # graphs hit a device-side assert (decode graphs with eager prefill equalled
        # transformers); until its cause is found, such models prefill eagerly.
        if (not self._use_cuda_graphs or mc.is_moe or self.expert_stores or self.tp is not None
                or mc.windowed_attention or mc.is_hybrid or self._prefill_capture_failed
                or backend_plans_on_host(backend_class(self.attention_backend))):
            return 0
        return min(self.config.prefill_graph_tokens, self.knobs.max_prefill_tokens)


    @property
    def _cuda_graph_max_batch(self) -> int:
        return min(self.config.cuda_graph_max_batch, self.knobs.max_running_requests)


    def _measure_cuda_graphs(self, model_ctx: int, probe_pool: KVPool) -> int:
        """Capture the decode graphs (and the prefill graphs, into their pool) over the
        profile run's small pool and return what they took, then drop them: the plan
        charges it before the real pool is sized (the real capture, over the real pool,
        takes the same or less: same shapes and kernels, the prefill graphs up to the
        configured chunk here, up to the fitted one there)."""
        before_forward(self.expert_stores, 0)  # the warm-ups heat no offloaded expert
        attn = self._attention(probe_pool)
        hybrid = self.model_config.is_hybrid
        bound = self.model.states if hybrid else None
        if hybrid:  # the warm-ups step the model: a state pool of the graphs' rows (its own plan line)
            from engine.kvcache.state_pool import StatePool

            self.model.bind_states(StatePool(self.model_config, self._cuda_graph_max_batch, self.dtype, self.device))
        graphs = DecodeGraphs(self.model, attn, self.device, page_size=self.config.page_size,
                              max_batch=self._cuda_graph_max_batch, max_context_tokens=model_ctx,
                              ring=bool(probe_pool.ring_layers), states=hybrid)
        prefill = None
        try:
            taken = graphs.capture_all()
            if self._prefill_graph_tokens:
                prefill = PrefillGraphs(self.model, attn, self.device, page_size=self.config.page_size,
                                        max_tokens=self._prefill_graph_tokens, max_context_tokens=model_ctx,
                                        shared_pool=graphs.memory_pool, ring=bool(probe_pool.ring_layers))
                try:
                    prefill_bytes = prefill.capture_all()
                except torch.OutOfMemoryError:
                    # Not worth failing a start that fits without them: prefill runs eagerly.
                    log.warning("CUDA graphs: no memory for the one-sequence prefill graphs in the plan's probe; "
                                "prefill runs eagerly")
                    prefill_bytes = None
                if prefill_bytes is None:
                    self._prefill_capture_failed = True
                taken += prefill_bytes or 0
            return taken
        finally:
            del graphs, prefill
            if hybrid:
                self.model.bind_states(bound)
            torch.cuda.empty_cache()


    def _fit_chunk(self, planner) -> MemoryPlan:
        """Plan with ``self.knobs`` as :func:`engine.memory.plan_fit.fit_plan` does: the
        context lowered to what the pool holds, down to ``--min-context``, and the
        prefill chunk halved or the running requests lowered (a hybrid model's first)
        only when even that floor does not fit; sets ``self.knobs`` to what fits.

        Raises:
            PlanDoesNotFit: with the plan at the configured chunk, whose message names
                what to change.
        """
        plan, knobs = fit_model_plan(planner, self.knobs, self.config, self.model_config)
        if not plan.fits:
            log.warning("the memory plan that does not fit:\n%s", plan.table())  # which line took the card
            raise PlanDoesNotFit(plan)
        if knobs.max_running_requests < self.knobs.max_running_requests and plan.requests_note:
            log.warning("the plan holds %d running requests, %s; the others wait their turn",
                        knobs.max_running_requests, plan.requests_note)
        self.knobs = knobs
        return plan


    def _measured_plan(self, knobs: PlanKnobs) -> MemoryPlan:
        """Run one worst-case step at ``knobs`` on a small pool and plan with what it
        measured."""
        assert self.device_memory is not None
        mc = self.model_config
        torch.cuda.empty_cache()
        probe_pool = self._kv_pool(profile_pool_pages(knobs))
        # Where the context grows (logged): after the weights, the profile step, the capture.
        growth = [self._outside_allocator_growth()]
        # A first start compiles the step's kernels here (minutes for some models): said.
        log.info("the plan's profile run: one prefill step of %d tokens", knobs.max_prefill_tokens)
        started = time.monotonic()
        try:
            peak = measure_step_peak(
                self.model, self._attention(probe_pool), probe_pool, knobs, mc.max_position_embeddings,
                vocab_size=self.vocab_size,
            )
        except torch.OutOfMemoryError:
            # The step does not fit at all: charge everything that was free.
            peak = None
        growth.append(self._outside_allocator_growth())
        graph_bytes = 0
        if peak is not None and self._use_cuda_graphs:
            # The graphs' memory does not depend on the prefill chunk: measured once,
            # however many chunks the plan tries.
            if self._graph_bytes_measured is None:
                model_ctx = min(mc.max_position_embeddings, self.config.max_model_len or mc.max_position_embeddings)
                self._graph_bytes_measured = self._measure_cuda_graphs(model_ctx, probe_pool)
            graph_bytes = self._graph_bytes_measured
        del probe_pool
        # Nothing of the profile stays cached: the pool is sized against a clean device.
        torch.cuda.empty_cache()
        growth.append(self._outside_allocator_growth())
        log.info("the profile step and the graphs' capture took %.1f s; CUDA context growth outside the allocator since the plan's probe: "
                 "%.0f MiB after the weights, %.0f MiB after the profile step, %.0f MiB after the CUDA graphs' "
                 "capture (if any)", time.monotonic() - started, *(g / 2**20 for g in growth))
        runtime = self._runtime_bytes()
        if peak is None:
            activation, sampler = self.device_memory.total_bytes, None
        else:
            activation, sampler = peak.forward_bytes, peak.sampler_bytes
        fp = make_footprint(
            mc, self.dtype, knobs, workspaces=self._workspaces(), measured_activation_bytes=activation,
            measured_sampler_bytes=sampler, runtime_bytes=runtime, cuda_graph_bytes=graph_bytes,
            weights=self.weight_size, gathers_context=backend_class(self.attention_backend).gathers_context,
        )
        self._measured_footprint = fp
        return make_plan(self.device_memory, knobs, fp)


    def _fit_measured(self) -> MemoryPlan:
        """The plan from the profile run, fitted as :meth:`_fit_chunk` fits. Where it does
        not fit and ``--cpu-experts auto`` placed the routed experts from estimates (the
        CUDA context, the decode graphs and the activation peak measure more than they
        priced), the fewest MoE layers' experts in host memory that the measured footprint
        fits at the configured chunk are moved there first, then the plan is fitted again:
        the placement the estimates would have made had they known, before a smaller
        prefill chunk (as at start). Sets ``self.knobs``.

        Raises:
            PlanDoesNotFit: as :meth:`_fit_chunk`, when even that does not fit.
        """
        assert self.device_memory is not None
        planner = self._measured_plan
        if self.config.cpu_experts == "auto" and self.tp is None and self.model_config.experts_offload:
            first, knobs = self._measured_plan(self.knobs), self.knobs
            auto = dataclasses.replace(knobs, cpu_experts="auto")
            wanted = 0 if first.fits else make_plan(self.device_memory, auto, self._measured_footprint).cpu_expert_layers
            if wanted > len(self.expert_stores):
                log.warning("the measured plan does not fit with the routed experts of %d MoE layers in host "
                            "memory (%s short): moving those of %d there, as the estimates' placement would "
                            "have", len(self.expert_stores), fmt_bytes(first.shortfall_bytes), wanted)
                self._offload_more_experts(wanted)
                self._graph_bytes_measured = None  # the decode graphs now read those experts over the bus
            else:  # the placement stays: the step measured at these knobs is not run again
                planner = lambda k: first if k == knobs else self._measured_plan(k)  # noqa: E731
        return self._fit_chunk(planner)


    def _runtime_bytes(self) -> int:
        """The plan's "CUDA context and runtime" line: this process's device memory
        outside the caching allocator (CUDA context, kernel modules, library handles).

        Two parts: what NVML already attributed to this process at start (its context,
        when NVML lists processes; inside a container it lists none and the plan counted
        that memory as other processes'), and what the process took since, less the
        growth of the allocator's reservations (charged on their own lines). The growth
        is measured from the allocator's reservation at start, not from zero, so memory
        the allocator held before the engine (an earlier engine in the same process)
        does not hide the context's growth.
        """
        dm = self.device_memory
        assert dm is not None
        own_at_start = 0 if dm.simulated else max(dm.total_bytes - dm.free_bytes - dm.others_bytes, 0)
        return own_at_start + max(self._outside_allocator_growth(), 0)


    def _outside_allocator_growth(self) -> int:
        """Bytes the device lost since the plan's probe that the caching allocator does not
        hold (context growth: kernel modules, library handles, graph executables)."""
        assert self.device_memory is not None
        free_now, _ = torch.cuda.mem_get_info(self.device)
        grown = self.device_memory.free_bytes - free_now
        return grown - (torch.cuda.memory_reserved(self.device) - self._reserved_at_start)


    def _num_pages(self, mc: ModelConfig) -> int:
        """Pool size in pages, the null page included (see EngineConfig for the order)."""
        cfg = self.config
        if self.plan is not None:
            return self.plan.num_pages + 1
        if (short := short_pool_warning(cfg, mc)) is not None:
            log.warning(short)
        self._fixed_pool = unplanned_pool(cfg, mc, kv_bytes_per_token(mc, self.kv_dtype, self._kv_ring) * cfg.page_size,
                                          self._ring_price)
        return self._fixed_pool.pages
