"""The engine's settings checked against the model's config, before anything loads
(torch-free): the service runs these before its port opens, ``headroom plan`` before it
prices, and the engine again at load (a model converted only then).

A number a person typed is honoured or refused, never cut: ``--cpu-experts 99`` on a
model of 48 MoE layers is refused, naming 48.
"""

from __future__ import annotations

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import SettingRefused
from engine.kvcache.ring_geometry import sliding_ring
from engine.memory.fixed_pool import check_host_room, unplanned_pool
from engine.memory.plan import PlanKnobs
from engine.parallel.split import check_shardable
from kernels.attention.kv_formats import check_head_dim, kv_values_bytes

# Bytes per element of a --dtype (engine.core.startup resolves the names to torch's).
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_cpu_experts(config: EngineConfig, mc: ModelConfig) -> None:
    """Refuse ``--cpu-experts N`` above the model's MoE layers, or above 0 for experts
    that stay on the device (:attr:`ModelConfig.experts_offload`).

    Raises:
        SettingRefused: naming the largest N (or ``none``).
    """
    if not config.cpu_experts.isdecimal():
        return
    asked, layers = int(config.cpu_experts), len(mc.moe_layers) if mc.is_moe else 0
    if asked > 0 and mc.is_moe and not mc.experts_offload:
        raise SettingRefused(f"--cpu-experts {asked}: {mc.architecture}'s experts (biases, clamped SwiGLU) "
                             "stay on the device; use --cpu-experts none (or auto)")
    if asked <= layers:
        return
    if layers == 0:
        raise SettingRefused(f"--cpu-experts {asked}: {mc.architecture} has no mixture-of-experts layers; "
                             "use --cpu-experts none (or auto)")
    raise SettingRefused(f"--cpu-experts {asked}: {mc.architecture} has {layers} mixture-of-experts layers; "
                         f"use --cpu-experts {layers} or fewer (or auto)")


def splittable(mc: ModelConfig) -> bool:
    """Whether ``--cpu-layers`` can keep some of ``mc``'s decoder layers on the CPU: a dense
    Llama/Qwen2/Qwen3-family decoder (no mixture of experts, linear attention, sliding
    windows or attention sinks)."""
    return not (mc.is_moe or mc.is_hybrid or mc.windowed_attention or mc.gemma4 is not None
                or mc.hidden_act != "silu" or mc.num_kv_layers != mc.num_layers)


def _cpu_without_card(config: EngineConfig) -> bool:
    """``--device cpu`` with no simulated card (``--device-total``): no plan is fitted,
    every layer and the KV pool live in host memory."""
    return config.device == "cpu" and config.device_total is None


def check_cpu_layers(config: EngineConfig, mc: ModelConfig) -> None:
    """Refuse ``--cpu-layers N`` of all the model's decoder layers or more (one stays on
    the device), or above 0 for a model it cannot split (:func:`splittable`).

    Raises:
        SettingRefused: naming the largest N, or the option that fits the model.
    """
    if not config.cpu_layers.isdecimal() or int(config.cpu_layers) == 0:
        return
    asked = int(config.cpu_layers)
    if not splittable(mc):
        other = " (its experts: --cpu-experts)" if mc.is_moe else ""
        raise SettingRefused(f"--cpu-layers {asked}: only dense Llama/Qwen2/Qwen3-family models split their layers "
                             f"between the device and the CPU, not {mc.architecture}{other}; use --cpu-layers 0 "
                             "(or auto)")
    if asked >= mc.num_layers:
        # One layer at least stays on the device (its KV pool is the step's page space):
        # every layer on the CPU is --device cpu.
        fix = ("; on --device cpu every layer runs on the CPU already, so --cpu-layers 0 (or auto) does the same"
               if _cpu_without_card(config) else ", or --device cpu to run every layer on the CPU")
        raise SettingRefused(f"--cpu-layers {asked}: {mc.architecture} has {mc.num_layers} decoder layers and one "
                             f"at least stays on the device; use --cpu-layers {mc.num_layers - 1} or fewer (or "
                             f"auto){fix}")


def check_kv_cache(config: EngineConfig, mc: ModelConfig) -> None:
    """Refuse a fixed ``--kv-cache`` that holds less than one ``--min-context`` of this
    model, as the engine would once loaded (:func:`engine.memory.fixed_pool.unplanned_pool`),
    and on ``--device cpu`` with no simulated card (no plan: the pools are in host memory)
    a fixed ``--kv-cache`` or ``--num-pages`` whose KV pool and sliding-window ring pool
    the host's available memory cannot hold (:func:`engine.memory.fixed_pool.check_host_room`).
    The KV dtype of ``--dtype auto`` is taken as bfloat16 unless ``--device cpu`` (the
    device ``auto`` picks is not known here), and sliding-window layers as keeping a ring
    unless ``--sliding-kv-ring off``: lower bounds, never a wrong refusal. Under tensor
    parallel (a rank's share) the engine checks it at load.

    Raises:
        SettingRefused: naming the size that holds one ``--min-context``, or the most
            the host holds.
    """
    if (config.kv_cache is None and config.num_pages is None) or config.tensor_parallel_size > 1:
        return
    if config.kv_cache_dtype != "auto":
        item = 1  # unused: f16 and fp8 have their own bytes, a block format prices its blocks
    elif config.dtype == "auto":
        item = _DTYPE_BYTES["float32" if config.device == "cpu" else "bfloat16"]
    else:
        item = _DTYPE_BYTES.get(config.dtype, min(_DTYPE_BYTES.values()))
    knobs = PlanKnobs.of(config)
    ring = None if config.sliding_kv_ring == "off" else sliding_ring(
        mc.kv_windows, max_chunk=knobs.max_prefill_tokens, page_size=knobs.page_size)

    def page(layers: int) -> int:
        return kv_values_bytes(config.kv_cache_dtype, 2 * mc.num_kv_heads * mc.head_dim * layers, item) * config.page_size

    # A KV pool page holds every layer but the sliding-window ones that keep a ring.
    page_bytes = max(page(mc.num_kv_layers - len(ring.layers)) if ring else kv_values_bytes(
        config.kv_cache_dtype, mc.kv_elements_per_token, item) * config.page_size, 1)
    price = ring.price(page(len(ring.layers)), knobs.max_running_requests, knobs.state_checkpoints) if ring else None
    pool = unplanned_pool(config, mc, page_bytes, price)
    if _cpu_without_card(config):
        check_host_room(config, pool, page_bytes, price)


def check_kv_cache_dtype(config: EngineConfig, mc: ModelConfig) -> None:
    """Refuse a block format of ``--kv-cache-dtype`` (``q8_0``, ``q4_0``) for heads
    that are not whole blocks of 32 values.

    Raises:
        SettingRefused: naming the option and the model's head dim.
    """
    try:
        check_head_dim(config.kv_cache_dtype, mc.head_dim)
    except ValueError as e:
        raise SettingRefused(str(e)) from None


def check_context(config: EngineConfig, mc: ModelConfig) -> None:
    """Refuse a ``--page-size`` larger than the model's context (a page no request could
    fill), and a ``--min-context`` other than its default beyond that context, which no
    plan could give a request (the default, 2048, is capped by a shorter model's context,
    and any ``--min-context`` by ``--max-model-len``, as their help says). The KV kernels
    themselves take any page size of at least one token (they address a position's slot
    as ``page * page_size + offset``).

    Raises:
        SettingRefused: naming the option and the model's context.
    """
    context = mc.max_position_embeddings
    if config.page_size > context:
        raise SettingRefused(f"--page-size {config.page_size} is larger than {mc.architecture}'s context of "
                             f"{context} tokens: give at most {context} (the default is 16)")
    default = EngineConfig.__dataclass_fields__["min_context"].default
    if config.min_context is not None and config.min_context != default and config.min_context > context:
        raise SettingRefused(f"--min-context {config.min_context} is more than {mc.architecture}'s context of "
                             f"{context} tokens: give at most {context}")


def check_for_model(config: EngineConfig, mc: ModelConfig) -> None:
    """Every check of ``config`` against ``mc`` (the whole model's config, not a rank's).

    Raises:
        SettingRefused: the first setting the model cannot honour, naming the fix.
    """
    check_shardable(mc, config.tensor_parallel_size)
    check_context(config, mc)
    check_cpu_experts(config, mc)
    check_cpu_layers(config, mc)
    check_kv_cache_dtype(config, mc)
    check_kv_cache(config, mc)
