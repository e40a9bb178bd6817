"""The kernels that produce the int8 GEMV's activations quantize their output in the same
launch: RMSNorm, residual-add + RMSNorm and SiLU-and-mul with ``quantize=True`` give the
same output bit for bit, and the codes, scales and sums ``quantize_activations`` gives
for it. Without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch


def _assert_q8_of(q8, out: torch.Tensor) -> None:
    """``q8`` equals :func:`quantize_activations` of ``out``'s rows bit for bit."""
    from kernels.quant import triton_int8

    want = triton_int8.quantize_activations(out.reshape(-1, out.shape[-1]))
    assert q8.dtype == out.dtype
    for name in ("codes", "scales", "sums"):
        got, ref = getattr(q8, name), getattr(want, name)
        assert got.dtype == ref.dtype and torch.equal(got, ref), name


PRODUCER_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [96, 576])
def test_norms_quantizing_their_output_equal_a_quantizing_launch(dev, dtype, m, k):
    """RMSNorm and residual-add + RMSNorm with ``quantize=True``: the same output (and
    residual) as without, bit for bit, and the codes, scales and sums of
    :func:`quantize_activations` of that output; rows of a width that is not a power of
    two (padding groups in the kernel's row), a group of zeros included."""
    from kernels.norm import triton_kernel as triton_norm

    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(dev)
    x[0, 32:64] = 0
    res = torch.randn(m, k, generator=g).to(dtype).to(dev)
    w = torch.randn(k, generator=g).to(dtype).to(dev)
    plain = triton_norm.rms_norm(x, w, 1e-6)
    out, q8 = triton_norm.rms_norm(x, w, 1e-6, quantize=True)
    assert torch.equal(out, plain)
    _assert_q8_of(q8, out)
    assert float(q8.scales[0, 1]) == 0
    res_plain = res.clone()
    plain, _ = triton_norm.fused_add_rms_norm(x, res_plain, w, 1e-6)
    out, r, q8 = triton_norm.fused_add_rms_norm(x, res, w, 1e-6, quantize=True)
    assert r is res and torch.equal(res, res_plain) and torch.equal(out, plain)
    _assert_q8_of(q8, out)


@pytest.mark.parametrize("dtype", PRODUCER_DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("inter", [96, 576, 1120])
def test_silu_and_mul_quantizing_its_output_equals_a_quantizing_launch(dev, dtype, m, inter):
    """SiLU-and-mul with ``quantize=True``: the same output bit for bit, and its codes as
    :func:`quantize_activations` gives them; 1120 columns take two programs a row (the
    second's groups start at 32), leading dimensions are kept."""
    from kernels.activation import triton_kernel as triton_activation

    g = torch.Generator().manual_seed(m + inter)
    x = (torch.randn(m, 1, 2 * inter, generator=g) * 3).to(dtype).to(dev)
    x[-1, 0, :32] = 0
    plain = triton_activation.silu_and_mul(x)
    out, q8 = triton_activation.silu_and_mul(x, quantize=True)
    assert out.shape == (m, 1, inter) and torch.equal(out, plain)
    _assert_q8_of(q8, out)


def test_producers_refuse_to_quantize_rows_of_partial_groups(dev):
    from kernels.activation import triton_kernel as triton_activation
    from kernels.norm import triton_kernel as triton_norm

    x = torch.randn(2, 48, device=dev)
    with pytest.raises(ValueError, match="whole groups of 32"):
        triton_norm.rms_norm(x, torch.ones(48, device=dev), 1e-6, quantize=True)
    with pytest.raises(ValueError, match="whole groups of 32"):
        triton_activation.silu_and_mul(torch.randn(2, 96, device=dev), quantize=True)  # 48 outputs a row
