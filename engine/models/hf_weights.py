"""Hugging Face checkpoint tensors into the decoder's parameters: q/k/v and gate/up fused
into one parameter each, a layer's experts stacked into ``[E, ...]`` parameters
(Mixtral's ``block_sparse_moe``/``w1``/``w3``/``w2`` names included), every tensor's
shape checked and every parameter's shards accounted for.

:class:`HFWeightLoading` is a part of :class:`engine.models.decoder.CausalLM` (it uses
the model's ``config``, ``lm_head`` and parameters); a family whose fused parameters
split otherwise overrides :meth:`HFWeightLoading._shard_view`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.common.load_errors import WeightMismatch

# The MLP's gate and up projections -> (our fused parameter, shard), dense or expert.
_GATE_UP = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# Hugging Face tensor -> (our fused parameter, shard). Shards are laid out in this order.
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    **_GATE_UP,
}

# Mixtral's names of an expert's projections: w1 (gate), w3 (up), w2 (down).
_MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# One expert's projection in a checkpoint -> (our stacked parameter, shard kind).
_EXPERT_PROJ = {**_GATE_UP, "down_proj": ("down_proj", "down")}
_EXPERT_PROJ.update({alias: _EXPERT_PROJ[name] for alias, name in _MIXTRAL_EXPERT_NAMES.items()})


# Mixtral's checkpoints call the sparse MLP ``block_sparse_moe``; transformers 5 and we ``mlp``.
_MOE_RENAMES = {"block_sparse_moe": "mlp"}


# Which part of a parameter one checkpoint tensor fills: None (all of it), a fused
# shard ("q", "gate", ...), or (kind, expert) of a stacked expert parameter.
Shard = str | tuple[str, int] | None


_MAX_NAMES_SHOWN = 8


class HFWeightLoading:
    """:meth:`load_weights` for the decoder (see the module docstring)."""

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors into the model, fusing q/k/v and gate/up and
        stacking each layer's experts.

        Args:
            weights: ``(name, tensor)`` pairs with Hugging Face names
                (``model.layers.N.self_attn.q_proj.weight``, ...), any dtype/device;
                they are cast to the parameter's. ``rotary_emb.inv_freq`` tensors are
                ignored (we compute our own), as is ``lm_head.weight`` of a tied model.
                An expert comes either per expert (``mlp.experts.E.gate_proj.weight``,
                Mixtral's ``block_sparse_moe.experts.E.w1.weight``), written into row
                ``E`` of the stacked parameter, or already stacked
                (``mlp.experts.gate_up_proj``).

        Raises:
            WeightMismatch: a tensor has no place in the model or the wrong shape, or a
                parameter received no tensor; the message lists the names (truncated).
        """
        params = dict(self.named_parameters())
        shards_of = {name: self._shards(name, p) for name, p in params.items()}
        expected = {(name, s) for name, shards in shards_of.items() for s in shards}
        loaded: set[tuple[str, Shard]] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue
            target, shard = self._target(hf_name)
            if target not in params:
                unexpected.append(hf_name)
                continue
            dest = self._shard_view(params[target], shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise WeightMismatch(
                    f"tensor {hf_name} has shape {tuple(tensor.shape)}, the config expects "
                    f"{tuple(dest.shape)}; config.json and the weights disagree"
                )
            dest.copy_(tensor)
            # A whole stacked tensor (transformers 5's own names) fills every shard.
            loaded.update((target, s) for s in ([shard] if shard is not None else shards_of[target]))
        missing = sorted(_shard_name(n, s) for n, s in expected - loaded)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing {len(missing)} tensors: {_names(missing)}")
            if unexpected:
                parts.append(f"unexpected {len(unexpected)} tensors: {_names(sorted(unexpected))}")
            raise WeightMismatch(
                "the weights do not match the config ("
                + "; ".join(parts)
                + "); the checkpoint is incomplete or of another architecture"
            )


    @staticmethod
    def _target(hf_name: str) -> tuple[str, Shard]:
        """Our parameter name and shard for a Hugging Face tensor name."""
        parts = hf_name.split(".")
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in _EXPERT_PROJ:
            # model.layers.N.mlp.experts.E.gate_proj.weight -> model.layers.N.mlp.experts.gate_up_proj
            stacked, kind = _EXPERT_PROJ[parts[-2]]
            prefix = [_MOE_RENAMES.get(p, p) for p in parts[:-3]]
            return ".".join([*prefix, stacked]), (kind, int(parts[-3]))
        parts = [_MOE_RENAMES.get(p, p) for p in parts]
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return ".".join(parts), None


    @staticmethod
    def _shards(name: str, param: torch.Tensor) -> list[Shard]:
        """The shards that fill parameter ``name`` (``[None]``: one tensor fills it)."""
        if name.endswith("experts.gate_up_proj"):
            return [(kind, e) for e in range(param.shape[0]) for kind in ("gate", "up")]
        if name.endswith("experts.down_proj"):
            return [("down", e) for e in range(param.shape[0])]
        for fused, shards in (("qkv_proj", ("q", "k", "v")), ("gate_up_proj", ("gate", "up"))):
            if f".{fused}.weight" in name or f".{fused}.bias" in name:
                return list(shards)
        return [None]


    def _shard_view(self, param: torch.Tensor, shard: Shard) -> torch.Tensor:
        """The part of a fused or stacked parameter that one Hugging Face tensor fills."""
        if shard is None:
            return param
        if isinstance(shard, tuple):  # one expert of a stacked [E, ...] parameter
            kind, expert = shard
            param = param[expert]
            shard = None if kind == "down" else kind
            if shard is None:
                return param
        cfg = self.config
        # gate/up split their parameter in halves: the dense MLP, the shared expert and
        # the routed experts each have their own intermediate size.
        half = param.shape[0] // 2
        offsets = {
            "q": (0, cfg.q_size),
            "k": (cfg.q_size, cfg.kv_size),
            "v": (cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate": (0, half),
            "up": (half, half),
        }
        start, size = offsets[shard]
        return param.narrow(0, start, size)



def _shard_name(name: str, shard: Shard) -> str:
    if shard is None:
        return name
    if isinstance(shard, tuple):
        return f"{name}[expert {shard[1]} {shard[0]}]"
    return f"{name}[{shard}]"


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return shown + (f", ... ({more} more)" if more > 0 else "")
