"""Frozen configuration records. Torch-free: the service builds these and sends them
to the worker.

``ModelConfig`` is the normalized description of a decoder-only transformer, built
from a Hugging Face ``config.json`` by :mod:`engine.loader.hf_config`. ``EngineConfig``
holds the knobs of one engine instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.common.gemma4_layout import Gemma4Layout
from engine.common.options import (
    at_least,
    auto_or_count,
    device_spec,
    nonzero_size,
    option,
    options_from,
    thread_count,
)
from engine.common.units import MiB
from kernels.attention.kv_formats import KV_CACHE_DTYPES
from kernels.switches import KernelSwitches

# The --attention-backend choices; engine.layers.attention.registry maps each built-in
# name to its class.
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "triton", "flashinfer", "torch")

# RoPE variants engine.layers.rope implements (transformers' ``rope_type`` names).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters (the names of transformers'
    ``rope_parameters`` / ``rope_scaling``). The scaled types read only the fields their
    comment names."""

    theta: float = 10000.0  # the base
    # "default", "linear", "llama3" or "yarn" (SUPPORTED_ROPE_TYPES)
    rope_type: str = "default"
    factor: float = 1.0  # linear, llama3, yarn: the context stretch
    # llama3: the wavelengths between which the scaling ramps
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # llama3, yarn: the trained context
    # yarn: the rotations bounding its ramp
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    # yarn: cos and sin scaled by it; 0: 0.1 * ln(factor) + 1
    attention_factor: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of one decoder-only model, all sizes in elements.

    ``head_dim`` is explicit because Qwen3 decouples it from ``hidden_size // num_heads``.
    ``qk_norm`` is Qwen3's per-head RMSNorm on queries and keys; ``attention_bias`` is
    Qwen2's bias on the q/k/v projections. ``qk_norm_whole`` is OLMoE's RMSNorm over the
    whole query and key projections (``[q_size]`` and ``[kv_size]`` weights) before the
    heads are split, and ``clip_qkv`` its optional clamp of q, k and v to ``±clip_qkv``.

    Mixture of experts (``num_experts > 0``): the layers in ``moe_layers`` replace the
    MLP by ``num_experts`` routed experts of ``moe_intermediate_size`` each, of which a
    router picks ``num_experts_per_tok`` per token (softmax over all experts, top-k,
    renormalized to sum 1 when ``norm_topk_prob``); ``shared_expert_intermediate_size >
    0`` adds Qwen2-MoE's always-on expert, scaled by ``sigmoid(shared_expert_gate(x))``.
    The other layers keep the dense MLP of ``intermediate_size``.

    Hybrid linear attention (``layer_types`` non-empty, Qwen3-Next, Qwen3.5/3.6): layer ``i`` is
    ``"linear_attention"`` (a Gated DeltaNet: ``linear_num_key_heads`` query/key heads of
    ``linear_key_head_dim``, ``linear_num_value_heads`` value heads of
    ``linear_value_head_dim``, a causal depthwise conv of ``linear_conv_kernel_dim`` taps)
    or ``"full_attention"`` (paged KV cache; only these layers have one). ``rotary_dim``
    is the part of each head RoPE turns (0: all of it; Qwen3-Next's
    ``partial_rotary_factor``); ``attn_output_gate`` multiplies the attention output by
    ``sigmoid`` of a second half of ``q_proj``. ``zero_centered_norms``: RMSNorm weights
    are stored as ``w - 1`` (``Qwen3NextRMSNorm`` scales by ``1 + w``).

    Sliding-window attention (Gemma 3): a ``"sliding_attention"`` layer of
    ``layer_types`` attends to the last ``sliding_window`` tokens only (the query's own
    included), rotating with ``rope_local``; the ``"full_attention"`` ones see the whole
    context with ``rope``. ``query_pre_attn_scalar`` (0: ``head_dim``) sets the attention
    scale to its inverse square root; ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (0: none) cap the attention scores and the logits at
    ``±c`` by ``c * tanh(x / c)``; ``hidden_act`` is the MLP's gate activation
    (``"silu"``, or ``"gelu_pytorch_tanh"``).

    gpt-oss: ``attention_sinks``, a learned logit per layer and head that joins each
    softmax's denominator (no value); ``expert_bias``, biases on the router and on each
    expert's gate/up and down; ``swiglu_limit`` > 0 makes the experts' activation
    the clamped SwiGLU (gate clamped above at the limit, up at ``±limit``, output
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``); the router then takes the
    top-k logits before a softmax over those alone. ``expert_block_type``: the GGML block
    type the routed experts are kept in as the checkpoint stores them (``"MXFP4"`` for
    OpenAI's gpt-oss checkpoints; ``""``: dense in the model dtype).

    Gemma 4: ``gemma4`` (:class:`~engine.common.gemma4_layout.Gemma4Layout`); its layers
    that share another's keys and values have no place in the KV pool.
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
    qk_norm_whole: bool = False
    clip_qkv: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    rotary_dim: int = 0
    attn_output_gate: bool = False
    zero_centered_norms: bool = False
    sliding_window: int = 0
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    hidden_act: str = "silu"
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    expert_block_type: str = ""
    gemma4: Gemma4Layout | None = None

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (they keep a per-request state, not KV)."""
        return "linear_attention" in self.layer_types

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache, in order; their position is their KV pool index."""
        own = self.num_layers - (self.gemma4.kv_shared_layers if self.gemma4 else 0)
        if not self.layer_types:
            return tuple(range(own))
        return tuple(i for i, t in enumerate(self.layer_types[:own]) if t != "linear_attention")

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layers)

    @property
    def kv_elements_per_token(self) -> int:
        """Keys and values of one token over the layers with a KV cache, in elements."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """Per KV pool layer (``kv_layers`` order), the tokens it attends to: the
        ``sliding_window`` for a ``"sliding_attention"`` layer, 0 (the whole context) for
        the others; empty when no layer slides."""
        if not self.sliding_window or "sliding_attention" not in self.layer_types:
            return ()
        return tuple(self.sliding_window if self.layer_types[i] == "sliding_attention" else 0 for i in self.kv_layers)

    @property
    def windowed_attention(self) -> bool:
        """Some layers slide, the scores are soft-capped or the softmax has sinks: the
        attention backend must implement
        :meth:`~engine.layers.attention.base.AttentionBackend.use_windows` (and take
        ``sinks``)."""
        return bool(self.kv_windows or self.attn_logit_softcapping or self.attention_sinks)

    @property
    def attention_scale(self) -> float:
        """The factor of ``q . k``: ``query_pre_attn_scalar ** -0.5`` (``head_dim`` when unset)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.moe_layers)

    @property
    def experts_offload(self) -> bool:
        """The routed experts may live in host memory behind the expert cache
        (``--cpu-experts``); not gpt-oss's, whose biases and clamped SwiGLU the cache's
        CPU runs do not compute."""
        return self.is_moe and not (self.expert_bias or self.swiglu_limit)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# The kernel switches as options (--quant-int8/--no-quant-int8, HEADROOM_QUANT_INT8,
# quant_int8 = ...): declared once, with their defaults and help, in kernels.switches.
KernelOptions = options_from(KernelSwitches, "KernelOptions", __name__)


@dataclass(frozen=True)
class EngineConfig(KernelOptions):
    """Knobs of one engine instance; each option is declared here once
    (:func:`engine.common.options.option`), and ``headroom serve``, ``generate`` and ``plan``
    build their flags, ``HEADROOM_*`` variables and config keys from these fields. The
    kernel switches come first, inherited from :data:`KernelOptions` (derived from
    :class:`kernels.switches.KernelSwitches`); the engine hands them to the kernels when
    it starts (:func:`kernels.switches.configure`).

    ``model`` is a path to a Hugging Face folder or a ``.gguf`` file, or ``None`` for the
    embedded default model. ``device`` is ``"auto"`` (CUDA when present), ``"cpu"`` or
    ``"cuda[:N]"``; ``dtype`` is ``"auto"`` (bfloat16 on CUDA, float32 on CPU),
    ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    ``page_size`` is in tokens. ``max_prefill_tokens`` caps the tokens one prefill step
    runs (the chunk of chunked prefill; None: by device, :func:`engine.memory.plan.prefill_chunk`).

    KV pool size, first that applies: ``num_pages`` (fixed); ``kv_cache`` (bytes,
    fixed); the memory plan on a CUDA device, or on a simulated one when
    ``device_total`` is set (total and free given, for machines without a GPU and for
    tests); on a CPU otherwise, a fixed 1 GiB default.

    Plan knobs (bytes; ``None`` = automatic): ``reserve`` (desktop reserve),
    ``safety_margin_bytes``, ``device_limit`` (plan as if the card were this big),
    ``min_context`` (tokens: smallest context one request must get for the plan to
    fit; default 2048: below the context asked for, the plan lowers it to what the
    pool holds, down to this floor).

    ``attention_backend``: ``auto`` (Triton on CUDA, torch elsewhere), ``triton``,
    ``flashinfer`` or ``torch``. ``cuda_graphs`` captures the decode step at batch sizes
    up to ``cuda_graph_max_batch`` (capped by ``max_running_requests``), and one
    sequence's prefill chunk of up to ``prefill_graph_tokens`` tokens (dense models;
    capped by ``max_prefill_tokens``).
    """

    model: str | None = option(
        None,
        "Hugging Face model folder or .gguf file; unset serves the "
        "embedded default model (SmolLM2-135M-Instruct).",
        # An empty path would be read as the current folder.
        checks=(lambda m: None if m.strip() else "is empty; leave --model out for the default model, or pass "
                "a model folder, a .gguf file or a store name",),
    )
    device: str = option("auto", "auto (CUDA when present), cpu, or cuda[:N].", checks=(device_spec,))
    dtype: str = option("auto", "The weights' and activations' dtype: auto is bfloat16 on CUDA, float32 on the CPU.",
                        choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = option(
        None,
        "Cap on tokens per request (prompt + completion); "
        "unset: the model's context, or what the KV cache holds.",
        checks=(at_least(2),),
    )
    max_running_requests: int | None = option(
        None, "Most requests decoded together; unset: 64, or fewer where the card cannot hold 64 (a hybrid "
        "model's states take at most 1/8 of the budget, 4 requests at least, lowered before the chunk).",
        checks=(at_least(1),)
    )
    max_prefill_tokens: int | None = option(
        None, "Most prompt tokens per prefill step (the chunk of chunked prefill); unset: 2048 on a GPU, "
        "256 on the CPU, where a long prompt's step is what every other request waits for its next token.",
        checks=(at_least(1),))
    page_size: int = option(16, "KV cache page size, in tokens.", checks=(at_least(1),))
    num_pages: int | None = option(
        None,
        "Fix the KV cache size in pages, skipping the memory plan (unset: planned).",
        checks=(at_least(2, "one page is the null page"),),
    )
    kv_cache: int | None = option(  # bytes
        None,
        "Fix the KV cache size (e.g. 2GiB), skipping the memory plan (unset: planned).",
        kind="size", unitless_min=MiB,
        checks=(nonzero_size,),
    )
    reserve: int | None = option(  # bytes; None: auto
        None,
        "GPU memory left to the desktop and other apps: auto (512 MiB + 5% of the card "
        "when it drives a display, else 0) or a size such as 1GiB.",
        kind="size_or_auto", unitless_min=MiB,
        shown_default="auto",
    )
    device_limit: int | None = option(  # bytes
        None,
        "Serve as on a GPU of this size (e.g. 16GiB; unset: the whole card): the plan, the VRAM watcher and live replans all read a card of this size, other processes' memory counting against it.",
        kind="size", unitless_min=MiB,
        checks=(nonzero_size,),
    )
    cpu_experts: str = option(
        "auto",
        "Mixture-of-experts layers whose routed experts live in pinned host memory, with a "
        "GPU expert cache sized from what is left in front of them: auto (the plan picks "
        "the fewest layers that make it fit; none when everything fits), none, or a number "
        "of layers. Offloaded layers decode slower: a missing expert is copied over PCIe "
        "or run on the CPU.",
        kind="word_or_number",
        metavar="auto|none|N",
        checks=(auto_or_count("none"),),
    )
    cpu_layers: str = option(
        "auto",
        "Decoder layers of a dense model kept on the CPU, the last ones: their weights and "
        "KV cache in host memory, run by the CPU each step (as llama.cpp's -ngl keeps the "
        "rest on the GPU): auto (0 when the model fits the device; else the fewest layers "
        "that make the plan fit) or a number. Layers on the CPU decode much slower than on "
        "the GPU, and decode then runs without CUDA graphs.",
        kind="word_or_number",
        metavar="auto|N",
        checks=(auto_or_count(what="decoder layers"),),
    )
    cpu_threads: str = option(
        "auto",
        "Threads for the engine's CPU work (the whole model with --device cpu, experts run "
        "on the CPU otherwise): auto (the cores this process may use less those other "
        "programs keep busy, re-read each second, so a busy desktop does not stall every "
        "step) or a fixed number.",
        kind="word_or_number",
        metavar="auto|N",
        checks=(thread_count,),
    )
    min_context: int | None = option(  # tokens
        2048,
        "Smallest context, in tokens, one request must get for the memory plan to fit: "
        "on a tight card the context is lowered (by pages) down to this, and grows back "
        "with the KV pool when memory frees up; capped by --max-model-len.",
        checks=(at_least(1),),
    )
    device_total: int | None = option(  # bytes
        None,
        "Simulate a GPU of this size instead of reading the real one (e.g. 6GiB), to try "
        "the memory plan on a machine without one; the engine still runs on --device.",
        kind="size",
        checks=(nonzero_size,),
    )
    device_free: int | None = option(  # bytes
        None,
        "Free memory of the simulated GPU (needs --device-total; unset: all of it).",
        kind="size",
    )
    device_display: bool = option(
        True,
        "Whether the simulated GPU (--device-total) drives a display, which the "
        "automatic --reserve keeps memory for.",
    )
    quantization: str = option(
        "auto",
        "Weights: auto (as the checkpoint stores them; an FP8 checkpoint stays FP8) or fp8 "
        "(quantize a bfloat16/float32 checkpoint's projections to float8_e4m3fn at load, one "
        "scale per output channel: about half of bfloat16's weight bytes).",
        choices=("auto", "fp8"),
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model's dtype), f16 (float16 for a float32 model, the CPU's: half its "
        "bytes; a 16-bit model's own dtype), fp8 (float8_e4m3fn, scale 1.0: half of bfloat16's bytes per "
        "token, twice the context in the same memory), q8_0 or q4_0 (llama.cpp's blocks of 32 values with "
        "a float16 scale: 34 or 18 bytes per 32 values, 0.53x or 0.28x of bfloat16's).",
        choices=KV_CACHE_DTYPES, kind="word",
    )
    prefix_cache: bool = option(True, "Share KV pages of common prompt prefixes.")
    sliding_kv_ring: str = option("auto", "Sliding-window layers keep only their window in the KV cache, in rings that grow with each request up to window + prefill chunk tokens (never more pages than the other layers'): auto/on (under tensor parallelism too; not with FlashInfer), off (every token kept).",
                                  choices=("auto", "on", "off"))
    attention_backend: str = option(
        "auto",
        "Attention kernels: auto (Triton on CUDA, torch elsewhere), triton, flashinfer "
        "(needs flashinfer-python) or torch.",
        choices=ATTENTION_BACKENDS,
    )
    cuda_graphs: bool = option(
        True, "Capture the decode step in CUDA graphs (--no-cuda-graphs: run eagerly)."
    )
    cuda_graph_max_batch: int = option(
        64,
        "Largest decode batch captured in a CUDA graph; larger batches run eagerly.",
        checks=(at_least(1, "turn graphs off with --no-cuda-graphs"),),
    )
    prefill_graph_tokens: int = option(
        512,
        "Largest one-sequence prefill chunk replayed from a CUDA graph (dense models, with "
        "CUDA graphs on); longer chunks, and steps of several sequences, run eagerly. 0: "
        "every prefill runs eagerly.",
        checks=(at_least(0),),
    )
    # Auto (None): on the CPU, where the blocks (or their int4 repacking) decode the
    # default model faster in a fifth of float32's memory (docs/cpu.md); off on CUDA, where the block
    # GEMV reads the weights once per decode row (measured on an H200, 8B Q4_K/Q6_K shape:
    # 327 tok/s from blocks against bfloat16's 216 at batch 1, 519 against 3,204 at 16).
    gguf_quantized: bool | None = option(
        None,
        "Keep a GGUF's quantized weights quantized. On the CPU (default there), "
        "Q4_0/Q4_1/Q8_0 projections stay in their blocks for headroom's C kernels (built "
        "at first use with the machine's C compiler; without one, and for Q5_0/Q5_1, "
        "repacked into torch's int4 layout), the token embeddings stay in blocks. On CUDA "
        "(default unless the model dequantized is under 1 GiB, where launches bound a step), "
        "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K projections stay in their block format: "
        "weights at about 37% of bfloat16's for Q4_K_M. "
        "Off: every weight dequantized at load.",
    )
    tensor_parallel_size: int = option(
        1,
        "Split the model across this many GPUs of this machine (tensor parallel; one "
        "rank process per GPU, NCCL; gloo with --device cpu). The heads must divide by it.",
        checks=(at_least(1),),
    )
    tp_cuda_graphs: bool = option(
        False,
        "With --tensor-parallel-size above 1, capture the decode step in CUDA graphs too "
        "(experimental: off, tensor-parallel ranks decode eagerly).",
    )
    # Not options (tests and benchmarks set them).
    load_format: str = "auto"  # "dummy": random weights of the config's shapes (benchmarks)
    safety_margin_bytes: int | None = None

    def problem(self) -> tuple[str, str] | None:
        """The first (option name, why) of options that do not go together, or None."""
        if self.quantization == "fp8" and self.gguf_quantized is True:
            # Both choose the weights' format: keeping one would price and load another.
            return "quantization", "fp8 does not go with --gguf-quantized (which keeps a GGUF's own blocks): drop one of the two"
        if self.cpu_layers not in ("auto", "0") and self.tensor_parallel_size > 1:
            return "cpu_layers", "does not go with --tensor-parallel-size above 1: use one of the two"
        if self.num_pages is not None and self.kv_cache is not None:  # else one would silently win
            return "num_pages", "does not go with --kv-cache (both fix the KV cache's size): give one of the two"
        if self.device_free is not None:
            if self.device_total is None:
                return "device_free", "needs --device-total (the size of the simulated GPU)"
            if self.device_free > self.device_total:
                return "device_free", "must not exceed --device-total"
        return None
