"""A layer's routed experts kept in GGUF block format on the device.

A GGUF stacks each layer's experts in three tensors, ``ffn_gate_exps`` and
``ffn_up_exps`` (``[E, I, H]`` weights) and ``ffn_down_exps`` (``[E, H, I]``), each of
one GGML type (a Q4_K_M file: gate and up Q4_K, down Q4_K or Q6_K). This module holds
their bytes unchanged, uint8 ``[E, rows, row_bytes]`` per projection, and takes the
place of :class:`engine.layers.moe.sparse_moe.Experts` in a
:class:`~engine.layers.moe.sparse_moe.SparseMoeBlock` (which calls it as it calls offloaded
experts: ``experts(x, weights, ids)``).

The product is :data:`kernels.dispatch.fused_moe_quant`: the Triton grouped GEMV
(decode) or GEMM (prefill) over the blocks on CUDA; elsewhere the reference, which
dequantizes each routed expert through ``gguf`` on every call (correct, slow). On the
CPU, experts of types the C kernels read (Q4_0/Q4_1/Q8_0, the K-quants, MXFP4:
:func:`kernels.cpu.moe_experts.takes`) run through them instead
(:func:`kernels.cpu.moe_experts.moe_experts`, all routed pairs in one call over the
cores; :meth:`QuantExperts.routed` routes inside that call too) where they build; a CPU engine keeps such experts in their blocks
(:mod:`engine.loader.gguf_quant`) and dequantizes the others at load.

gpt-oss's experts (MXFP4 blocks, from its GGUF or OpenAI's safetensors) carry biases on
gate/up and down and take the clamped SwiGLU; both are applied inside the kernels'
epilogues (:func:`quant_experts_for` builds such a layer from the model's config).

The blocks are buffers, not parameters, as :class:`~engine.layers.linear.gguf_blocks.QuantLinear`'s:
:mod:`engine.loader.gguf_quant` (or :meth:`engine.models.gpt_oss.GptOssCausalLM.load_weights`)
fills them; the biases are parameters, loaded as the dense experts' are.

A CPU engine interleaves the blocks by 16 rows per expert at load where the build
multiplies that layout (:meth:`QuantExperts.interleave_rows16`, called by
:func:`~engine.layers.cpu_pack.pack_model_for_cpu`; ``types`` then name it, ``Q4_Kx16``);
experts a GPU engine keeps in host memory keep the file's layout, which its kernels read.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.common.config import ModelConfig
from kernels.activation.reference import ClampedSwiGLU
from kernels.cpu import rows16
from kernels.cpu.moe_experts import (
    file_stack,
    file_types,
    interleave_stack,
    moe_experts_routed,
    takes,
)
from kernels.dispatch import fused_moe_quant
from kernels.moe.reference import ExpertBiases
from kernels.quant.formats import block_format, tensor_bytes


def experts_activation(config: ModelConfig) -> ClampedSwiGLU | None:
    """The routed experts' activation: gpt-oss's clamped SwiGLU where the config has a
    limit, else None (SiLU-and-mul)."""
    return ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit) if config.swiglu_limit else None


# Experts torch interleaves a copy at a time (no C build given): its temporaries stay a few MB.
_INTERLEAVE_EXPERTS = 16


class QuantExperts(nn.Module):
    """One layer's ``num_experts`` routed experts as GGUF blocks.

    Args:
        num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        types: GGML type names of gate, up and down (each one
            :mod:`kernels.quant.formats` reads); ``H`` must be whole blocks of the gate's
            and up's types, ``I`` of the down's.
        bias: parameters ``gate_up_proj_bias`` ``[E, 2I]`` (gate half first) and
            ``down_proj_bias`` ``[E, H]``, as :class:`~engine.layers.moe.sparse_moe.Experts`'.
        activation: None for SiLU-and-mul, else gpt-oss's clamped SwiGLU.

    Buffers ``gate`` ``[E, I, H / block_elements * block_bytes]``, ``up`` (same rows),
    ``down`` ``[E, H, I / ...]``, uint8. Build under ``torch.device("meta")`` and
    materialize (:func:`engine.loader.meta_build.materialize`) like the rest of the model.

    Raises:
        ValueError: a type the kernels do not read, or sizes that are not whole blocks.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 types: tuple[str, str, str], bias: bool = False, activation: ClampedSwiGLU | None = None) -> None:
        super().__init__()
        for t in types:
            block_format(t)
        self.types = tuple(types)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        for name, type_name, rows, cols in (("gate", types[0], intermediate_size, hidden_size),
                                            ("up", types[1], intermediate_size, hidden_size),
                                            ("down", types[2], hidden_size, intermediate_size)):
            self.register_buffer(name, torch.empty(num_experts, rows, tensor_bytes(type_name, (1, cols), 0),
                                                   dtype=torch.uint8))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
        self.activation = activation

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def biases(self) -> ExpertBiases | None:
        if self.gate_up_proj_bias is None:
            return None
        return ExpertBiases(self.gate_up_proj_bias, self.down_proj_bias)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """As :func:`kernels.moe.reference.fused_moe` with this layer's experts: ``x`` ``[T, H]``,
        ``topk_weights``/``topk_ids`` ``[T, K]`` -> ``[T, H]`` in ``x``'s dtype."""
        lib = self._cpu_kernels() if x.device.type == "cpu" and takes(self.types) else None
        if lib is not None:
            from kernels.cpu.moe_experts import moe_experts

            top_k = topk_ids.shape[1]
            tokens = torch.arange(x.shape[0]).repeat_interleave(top_k)
            out = moe_experts(lib, x, tokens, topk_ids.reshape(-1), topk_weights.reshape(-1), self.gate,
                              self.up, self.down, self.types, biases=self.biases, activation=self.activation)
            return out.to(x.dtype)
        # interleaved blocks (the C kernels switched off since the load) put back for the reference
        gate, up, down = (file_stack(w, t) for w, t in zip((self.gate, self.up, self.down), self.types, strict=True))
        types = file_types(self.types)
        if self.biases is None and self.activation is None:  # every family's but gpt-oss's
            return fused_moe_quant(x, gate, up, down, types, topk_weights, topk_ids)
        return fused_moe_quant(x, gate, up, down, types, topk_weights, topk_ids, biases=self.biases,
                               activation=self.activation)

    def routed(self, x: torch.Tensor, router: nn.Linear, top_k: int, renormalize: bool) -> torch.Tensor | None:
        """The layer on float32 ``x`` ``[T, H]`` with the pairs routed by ``router``
        (``[E, H]``, a bias or none) inside the C kernels' one call
        (:func:`kernels.cpu.moe_experts.moe_experts_routed`, ``route``'s rule): float32
        ``[T, H]``. None where that call does not run (not the CPU, not float32 ``x`` and
        router, types it does not read, no build, switched off): the caller routes and
        calls the layer."""
        if (x.device.type != "cpu" or x.dtype != torch.float32 or router.weight.dtype != torch.float32
                or not takes(self.types)):
            return None
        lib = self._cpu_kernels()
        if lib is None:
            return None
        return moe_experts_routed(lib, x, router.weight, router.bias, top_k, renormalize, self.gate, self.up,
                                  self.down, self.types, biases=self.biases, activation=self.activation)

    def interleave_rows16(self, lib=None) -> None:
        """Each of gate, up and down whose type and rows :func:`kernels.cpu.rows16.takes`
        interleaved by 16 rows per expert (:func:`~kernels.cpu.moe_experts.interleave_stack`;
        by the C pass over the threads with ``lib``, else torch's, a few experts at a time),
        the three in one buffer of huge pages, its type renamed (``Q4_Kx16``); the file's
        blocks dropped as each copy is written. For experts the C kernels run on the CPU,
        on a build that multiplies the layout (:func:`kernels.cpu.rows16.available`)."""
        names = [n for n, t in zip(("gate", "up", "down"), self.types, strict=True)
                 if rows16.takes(t, getattr(self, n).shape[1])]
        if not names:  # MXFP4, or rows not a multiple of 16
            return
        views = rows16.huge_buffer([tuple(getattr(self, n).shape) for n in names])
        types = dict(zip(("gate", "up", "down"), self.types, strict=True))
        for name, view in zip(names, views, strict=True):
            stack = getattr(self, name)
            step = stack.shape[0] if lib is not None else _INTERLEAVE_EXPERTS  # torch's temporaries bounded
            for e in range(0, stack.shape[0], step):
                interleave_stack(stack[e:e + step], types[name], lib, out=view[e:e + step])
            setattr(self, name, view)
            types[name] += rows16.SUFFIX
        self.types = tuple(types.values())

    def _cpu_kernels(self):
        """The C CPU kernels (built once), or None where they cannot run or are switched
        off (:mod:`kernels.switches`); asked at each call, not kept on the module (which
        then deep-copies)."""
        from engine.layers.linear.cpu_kernels import cpu_kernels
        from kernels.switches import current

        return cpu_kernels() if current().cpu_kernels else None

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"types={'/'.join(self.types)}")


def quant_experts_for(config: ModelConfig, types: tuple[str, str, str]) -> QuantExperts:
    """A layer of ``config``'s routed experts in blocks of ``types`` (gate, up, down), with
    its biases and activation (gpt-oss's) where the config has them.

    Raises:
        ValueError: as :class:`QuantExperts`.
    """
    return QuantExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, types,
                        config.expert_bias, experts_activation(config))
