"""A linear layer whose weight is float8_e4m3fn with one float32 scale per output row.

``W[n, :] = weight[n, :] * weight_scale[n]`` (``--quantization fp8``, or an FP8
checkpoint: a per-tensor scale is the same scale on every row). The product:

- on a CUDA card with FP8 tensor cores (compute capability 8.9+: Ada, Hopper) and
  shapes ``torch._scaled_mm`` takes (``K`` and ``N`` multiples of 16), the activations
  are quantized per row (token) to e4m3 with a dynamic scale ``amax / 448`` and
  multiplied on the tensor cores with row-wise scales on both sides (vLLM's
  "dynamic per-token" FP8 scheme);
- elsewhere (the CPU, older cards, odd shapes) the weight is upcast to the
  activations' dtype per call and scaled (weight-only FP8: the memory saving stays, the
  product is the dense one). This is also the reference the tests compare against.

The projections swapped in are the dense layers' ``qkv_proj``, ``o_proj``,
``gate_up_proj`` and ``down_proj`` (:func:`swap_projections`); embeddings, norms, the
LM head and a mixture of experts' routed experts stay in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
# Largest finite float8_e4m3fn value (OCP FP8 spec).
FP8_MAX = 448.0
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float dtype) -> (``[N, K]`` float8_e4m3fn, ``[N]`` float32
    scales) with ``scale = amax(|w[n]|) / 448`` (a zero row gets scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
    return q, scale


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None]).T (+ bias)``.

    Parameters (filled by ``CausalLM.load_weights`` like any other, fused shards
    included): ``weight [out_features, in_features]`` float8_e4m3fn,
    ``weight_scale [out_features]`` float32, ``bias [out_features]`` in the model dtype
    when there is one.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_WEIGHT_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` upcast and scaled, in ``dtype``."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def _scaled_mm_fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == torch.bfloat16 and self.in_features % 16 == 0 and self.out_features % 16 == 0
                and _has_fp8_tensor_cores(x.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self._scaled_mm_fits(x2):
            xf = x2.float()
            x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [M, 1]
            xq = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_WEIGHT_DTYPE)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                                 out_dtype=x.dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self.dequantized(x.dtype), self.bias)
        return y.reshape(*shape[:-1], self.out_features)


def swap_projections(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` named one of :data:`PROJECTIONS` with an
    :class:`Fp8Linear` of the same shape on the same device (meta, before the weights
    load); returns how many were replaced."""
    swapped = 0
    for module in list(model.modules()):
        for name in PROJECTIONS:
            lin = getattr(module, name, None)
            if isinstance(lin, nn.Linear):
                setattr(module, name, Fp8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                                dtype=dtype, device=lin.weight.device))
                swapped += 1
    return swapped
