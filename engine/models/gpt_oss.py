"""gpt-oss (``GptOssForCausalLM``), as transformers' ``modeling_gpt_oss`` computes it.

Its layers are the decoder's (:mod:`engine.models.decoder`) with what its config records
(:func:`engine.loader.hf_config._gpt_oss_fields`):

- q/k/v and o with biases; a learned sink logit per head joining each softmax's
  denominator (:attr:`~engine.models.decoder.Attention.sinks`, the attention backend's
  ``sinks``);
- ``"sliding_attention"`` layers over the last ``sliding_window`` tokens alternating with
  ``"full_attention"`` ones (the backend's windows, :attr:`ModelConfig.kv_windows`), all
  rotating with one YaRN-scaled RoPE (:mod:`engine.layers.rope`);
- a mixture of experts in every layer: a router with a bias whose top-k logits are
  softmaxed alone, experts with biases and the clamped SwiGLU
  (:class:`~engine.layers.moe.sparse_moe.SparseMoeBlock`).

What differs is the checkpoint: the router is ``mlp.router``; the experts are stacked
transposed, ``gate_up_proj`` ``[E, H, 2I]`` with gate and up columns interleaved (gate
the even ones) and ``down_proj`` ``[E, I, H]``. :meth:`GptOssCausalLM.load_weights` turns
them into the stacked layout of :class:`~engine.layers.moe.sparse_moe.Experts`
(``[E, 2I, H]`` gate rows first, ``[E, H, I]``). Experts in MXFP4 blocks, as OpenAI
publishes them (``gate_up_proj_blocks`` ``[E, 2I, H / 32, 16]`` uint8, two 4-bit E2M1
values a byte, low nibble first, with ``gate_up_proj_scales`` ``[E, 2I, H / 32]``, one
power of two a block of 32, biased by 127; ``down_proj_*`` the same over ``[E, H, I]``),
stay in their blocks: the model's experts are then
:class:`~engine.layers.moe.quant_experts.QuantExperts` (``ModelConfig.expert_block_type``),
whose kernels read GGML's ``block_mxfp4``, and the blocks are repacked into it at load
(:func:`mxfp4_to_ggml`: the same codes and scales, bit for bit; gate and up rows
de-interleaved). A model built with dense experts from such a checkpoint gets them
dequantized into its dtype (:func:`mxfp4_to_dense`; exact: every MXFP4 value is a
bfloat16 one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from engine.common.load_errors import UnsupportedConfig, WeightMismatch
from engine.layers.moe.quant_experts import QuantExperts
from engine.models.decoder import CausalLM

log = logging.getLogger("headroom.engine")

_MXFP4_SUFFIXES = ("_blocks", "_scales")

# The 16 values of a 4-bit E2M1 code (sign bit highest): OCP's microscaling formats spec.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to_dense(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 rows to ``dtype``: ``blocks`` ``[E, R, G, 16]`` uint8 (two codes a byte, the
    low nibble the even element), ``scales`` ``[E, R, G]`` uint8 (``2 ** (s - 127)`` for
    each block of 32) -> ``[E, R, G * 32]``, one expert at a time (the transient is one
    expert's codes).

    Raises:
        ValueError: the shapes do not pair.
    """
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair")
    lut = torch.tensor(_E2M1, dtype=dtype)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype)
    for e in range(blocks.shape[0]):
        codes = blocks[e]
        values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)  # [R, G, 32]
        exponents = scales[e].to(torch.int32)[..., None] - 127
        out[e] = torch.ldexp(values, exponents).flatten(-2).to(dtype)
    return out


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 rows as GGML's ``block_mxfp4`` rows (what llama.cpp's converter writes
    and :mod:`kernels.quant.formats` reads as ``"MXFP4"``): ``blocks`` ``[..., G, 16]``
    uint8 (byte j: element 2j low, 2j + 1 high) and ``scales`` ``[..., G]`` uint8 ->
    ``[..., G * 17]`` uint8, each block its scale byte then 16 bytes, byte j holding
    element j low and j + 16 high. The same codes and exponents: lossless.

    Raises:
        ValueError: the shapes do not pair.
    """
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "do not pair")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], element order
    packed = torch.cat((scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)
    return packed.flatten(-2)


def _check_pair(base: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Refuse an MXFP4 pair whose tensors do not go together (``blocks`` ``[..., G, 16]``
    uint8 over ``scales`` ``[..., G]`` uint8), naming both tensors.

    Raises:
        WeightMismatch: the pair's shapes or dtypes disagree.
    """
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16
            or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
        raise WeightMismatch(
            f"tensors {base}_blocks {str(blocks.dtype).removeprefix('torch.')} {tuple(blocks.shape)} and "
            f"{base}_scales {str(scales.dtype).removeprefix('torch.')} {tuple(scales.shape)} are not an MXFP4 pair "
            "(uint8 [..., G, 16] blocks over uint8 [..., G] scales); the checkpoint's files are damaged or not "
            "gpt-oss's MXFP4 layout: download them again")


def _fill_blocks(experts: QuantExperts, base: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """``experts``' buffers from a checkpoint's MXFP4 pair named ``base`` (``...gate_up_proj``:
    rows ``[E, 2I]`` with gate and up interleaved, gate the even ones; ``...down_proj``:
    ``[E, H]``), repacked (:func:`mxfp4_to_ggml`).

    Raises:
        WeightMismatch: the blocks' shape is not the layer's.
    """
    ggml = mxfp4_to_ggml(blocks, scales)
    parts = ((experts.gate, ggml[:, 0::2]), (experts.up, ggml[:, 1::2])) if base.endswith("gate_up_proj") \
        else ((experts.down, ggml),)
    for buf, src in parts:
        if tuple(src.shape) != tuple(buf.shape):
            raise WeightMismatch(f"tensor {base}_blocks holds MXFP4 rows {tuple(src.shape)}, the config expects "
                                 f"{tuple(buf.shape)}; config.json and the weights disagree")
        buf.copy_(src)


def _dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 kept: dict[str, QuantExperts]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each pair of MXFP4 ``*_blocks``/``*_scales`` tensors either copied
    into the blocks of its layer in ``kept`` (``model.layers.N.mlp.experts`` -> the
    layer), or replaced by the dense tensor under the checkpoint's bfloat16 name and
    layout (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``: views,
    transposed).

    Raises:
        UnsupportedConfig: a tensor without its pair, or a layer in ``kept`` whose
            blocks some of the checkpoint's pairs filled and others did not.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    filled: set[str] = set()
    logged = False
    for name, tensor in weights:
        suffix = next((s for s in _MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            _check_pair(base, parts["_blocks"], parts["_scales"])
            layer = kept.get(base.rpartition(".")[0])
            if layer is not None:
                with torch.no_grad():
                    _fill_blocks(layer, base, parts["_blocks"], parts["_scales"])
                filled.add(base)
                continue
            if not logged:
                log.info("gpt-oss: the experts' MXFP4 blocks are dequantized to %s at load "
                         "(they take the dense experts' memory)", str(dtype).removeprefix("torch."))
                logged = True
            yield base, mxfp4_to_dense(parts["_blocks"], parts["_scales"], dtype).transpose(1, 2)
    if pending:
        raise UnsupportedConfig(f"MXFP4 tensors without their pair: {', '.join(sorted(pending))}")
    unfilled = sorted(f"{m}.{p}" for m in kept for p in ("gate_up_proj", "down_proj") if f"{m}.{p}" not in filled)
    if filled and unfilled:
        raise UnsupportedConfig(f"MXFP4 experts missing from the checkpoint: {', '.join(unfilled)}")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` with gate and up interleaved (gate at even indices) -> gate half first."""
    return torch.cat((t[..., ::2], t[..., 1::2]), dim=-1)


def hf_to_ours(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One gpt-oss checkpoint tensor (bfloat16 layout) under the name and layout of our
    parameter."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if name.endswith(".mlp.experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gate rows first
        return name, _deinterleave(tensor).transpose(1, 2)
    if name.endswith(".mlp.experts.gate_up_proj_bias"):
        return name, _deinterleave(tensor)
    if name.endswith(".mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return name, tensor.transpose(1, 2)
    return name, tensor


class GptOssCausalLM(CausalLM):
    """gpt-oss over the paged KV cache; :class:`CausalLM`'s life cycle and forward. No
    tensor parallelism yet (the sinks are per head and not split), and the C decode layer
    declines it (:meth:`engine.layers.cpu_decode.CpuDecode.build`)."""

    def use_parallel(self, tp, full_vocab_size: int) -> None:
        raise ValueError("gpt-oss does not run tensor-parallel yet; use --tensor-parallel-size 1")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights` of a gpt-oss checkpoint: MXFP4 experts copied
        into the layers' blocks where the model keeps them so (else dequantized), the
        router renamed, the dense experts transposed and de-interleaved
        (:func:`hf_to_ours`). A layer in blocks that the weights hold none of (a GGUF's,
        filled beforehand) is left as it is.

        Raises:
            UnsupportedConfig: an MXFP4 tensor without its pair, or only some layers'.
            WeightMismatch: as :meth:`CausalLM.load_weights`; MXFP4 blocks of another shape.
        """
        dtype = self.model.norm.weight.dtype
        kept = {name: m for name, m in self.named_modules() if isinstance(m, QuantExperts) and m.types == ("MXFP4",) * 3}

        def ours() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _dequantized(weights, dtype, kept):
                yield hf_to_ours(name, tensor)

        super().load_weights(ours())
