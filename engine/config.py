"""Frozen configuration records. Torch-free: the service builds these and sends them
to the worker.

``ModelConfig`` is the normalized description of a decoder-only transformer, built
from a Hugging Face ``config.json`` by :mod:`engine.loader.hf_config`. ``EngineConfig``
holds the knobs of one engine instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# RoPE variants engine.models.rope implements (transformers' ``rope_type`` names).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    ``rope_type`` is one of ``"default"``, ``"linear"``, ``"llama3"`` (the names used by
    transformers' ``rope_parameters`` / ``rope_scaling``). ``theta`` is the base.
    ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` are read only by the scaled types.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of one decoder-only model, all sizes in elements.

    ``head_dim`` is explicit because Qwen3 decouples it from ``hidden_size // num_heads``.
    ``qk_norm`` is Qwen3's per-head RMSNorm on queries and keys; ``attention_bias`` is
    Qwen2's bias on the q/k/v projections.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance.

    ``model`` is a path to a Hugging Face folder or a ``.gguf`` file, or ``None`` for the
    embedded default model. ``device`` is ``"auto"`` (CUDA when present), ``"cpu"`` or
    ``"cuda[:N]"``; ``dtype`` is ``"auto"`` (bfloat16 on CUDA, float32 on CPU),
    ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    ``page_size`` is in tokens. ``max_prefill_tokens`` caps the tokens one prefill step
    runs (the chunk of chunked prefill).

    KV pool size, first that applies: ``num_pages`` (fixed); ``kv_cache_bytes`` (fixed);
    the memory plan on a CUDA device, or on a simulated one when
    ``simulate_device_total_bytes`` is set (total and free given, for machines without
    a GPU and for tests); on a CPU otherwise, a fixed 1 GiB default.

    Plan knobs (bytes; ``None`` = automatic): ``reserve_bytes`` (desktop reserve),
    ``safety_margin_bytes``, ``device_limit_bytes`` (plan as if the card were this
    big), ``min_context_tokens`` (smallest context one request must get for the plan to
    fit; default the model's context).

    ``attention_backend``: ``auto`` (Triton on CUDA, torch elsewhere), ``triton``,
    ``flashinfer`` or ``torch``. ``cuda_graphs`` captures the decode step at batch sizes
    up to ``cuda_graph_max_batch`` (capped by ``max_running_requests``).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    max_model_len: int | None = None
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"  # auto | triton | flashinfer | torch (engine.attention.base)
    cuda_graphs: bool = True  # capture the decode step (CUDA, and a backend that allows it)
    cuda_graph_max_batch: int = 64  # largest captured decode batch; larger ones run eagerly
    load_format: str = "auto"  # "dummy": random weights of the config's shapes (benchmarks)
    reserve_bytes: int | None = None
    safety_margin_bytes: int | None = None
    device_limit_bytes: int | None = None
    min_context_tokens: int | None = None
    simulate_device_total_bytes: int | None = None
    simulate_device_free_bytes: int | None = None
    simulate_display_attached: bool = False
