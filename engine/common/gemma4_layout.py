"""What Gemma 4's text model adds to :class:`~engine.common.config.ModelConfig`.

Torch-free, a frozen record of the config (``Gemma4TextConfig``), carried by
``ModelConfig.gemma4``; :mod:`engine.models.gemma4` builds the model from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gemma4Layout:
    """Gemma 4's per-layer-kind attention shapes, shared KV, per-layer embeddings.

    The two layer kinds have heads of their own sizes; the KV pool holds one shape for
    every layer, the larger of each (``ModelConfig.head_dim`` and ``num_kv_heads``), so a
    layer's keys and values are padded with zeros to its head size and its KV heads
    repeated to its count (the attention scale is 1, so zeros change no score).

    Attributes:
        sliding_head_dim, sliding_kv_heads: the ``"sliding_attention"`` layers' heads.
        global_head_dim, global_kv_heads: the ``"full_attention"`` layers' heads.
        global_rotary_fraction: the share of a global head's frequencies that turn
            (transformers' ``proportional`` RoPE: the first ``fraction * head_dim / 2``
            frequencies of plain RoPE over the whole head, the others 0).
        kv_shared_layers: the last this many layers have no keys and values of their
            own: each reads those of the last earlier layer of its kind.
        keys_as_values: the global layers have no ``v_proj``: their values are the key
            projection (before the key norm and RoPE), under the value norm.
        per_layer_input_size: the per-layer embeddings' width for each layer (0: none).
        double_wide_mlp: the KV-sharing layers' MLP is twice ``intermediate_size``.
    """

    sliding_head_dim: int
    sliding_kv_heads: int
    global_head_dim: int
    global_kv_heads: int
    global_rotary_fraction: float = 1.0
    kv_shared_layers: int = 0
    keys_as_values: bool = False
    per_layer_input_size: int = 0
    double_wide_mlp: bool = False
