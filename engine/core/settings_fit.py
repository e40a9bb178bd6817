"""The engine's settings checked against the model's config, before anything loads
(torch-free): the service runs these before its port opens, ``headroom plan`` before it
prices, and the engine again at load (a model converted only then).

A number a person typed is honoured or refused, never cut: ``--cpu-experts 99`` on a
model of 48 MoE layers is refused, naming 48.
"""

from __future__ import annotations

from engine.common.config import EngineConfig, ModelConfig
from engine.common.errors import SettingRefused
from engine.parallel.split import check_shardable


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


def check_for_model(config: EngineConfig, mc: ModelConfig) -> None:
    """Every check of ``config`` against ``mc`` (the whole model's config, not a rank's).

    Raises:
        SettingRefused: the first setting the model cannot honour, naming the fix.
    """
    check_shardable(mc, config.tensor_parallel_size)
    check_cpu_experts(config, mc)
