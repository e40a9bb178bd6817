"""The C decode step of Gated DeltaNet layers (kernels/cpu/gated_delta.c) against its
torch reference: outputs and both pools after several steps, fresh and continued
sequences in one batch, at one and two threads."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.gated_delta import gdn_decode, gdn_decode_ref


def _layer(hk: int, hv: int, dk: int, dv: int, kernel: int, slots: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    conv_pool = torch.randn(slots, channels, kernel - 1, generator=gen)
    ssm_pool = torch.randn(slots, hv, dk, dv, generator=gen) * 0.1
    params = (torch.randn(channels, 1, kernel, generator=gen) * 0.5, torch.randn(hv, generator=gen),
              torch.rand(hv, generator=gen) + 0.5)
    return gen, channels, conv_pool, ssm_pool, params


@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 16, 8), (1, 3, 32, 24), (2, 4, 128, 128)])
def test_the_c_decode_step_equals_its_torch_reference(lib, hk, hv, dk, dv):
    """Three rows (slots 2, 0, 3; the middle one fresh on the first step), four steps:
    outputs, conv pool and states within float32 order of the reference at every step."""
    gen, channels, conv_pool, ssm_pool, (weight, a_log, dt_bias) = _layer(hk, hv, dk, dv, 4, 5, seed=dk + hv)
    slots = torch.tensor([2, 0, 3])
    pools = {threads: (conv_pool.clone(), ssm_pool.clone()) for threads in (1, 2)}
    ref = (conv_pool.clone(), ssm_pool.clone())
    for step in range(4):
        fresh = torch.tensor([False, step == 0, False])
        mixed = torch.randn(3, channels, generator=gen)
        a, b = torch.randn(3, hv, generator=gen), torch.randn(3, hv, generator=gen)
        want = gdn_decode_ref(mixed, *ref[:1], weight, a, b, a_log, dt_bias, ref[1], slots, fresh, hk)
        for threads, (conv, ssm) in pools.items():
            got = gdn_decode(lib, mixed, conv, weight, a, b, a_log, dt_bias, ssm, slots, fresh, hk, threads=threads)
            assert got.shape == (3, hv, dv) and got.dtype == torch.float32
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (step, threads, float((got - want).abs().max()))
            assert torch.allclose(conv, ref[0], rtol=0, atol=0), (step, threads)
            assert torch.allclose(ssm, ref[1], rtol=1e-4, atol=1e-5), (step, threads)
        assert torch.equal(ssm_pool[1], pools[1][1][1])  # an unused slot is left as it was


def test_the_c_decode_step_refuses_what_does_not_fit(lib):
    _, channels, conv_pool, ssm_pool, (weight, a_log, dt_bias) = _layer(2, 4, 16, 8, 4, 2, seed=1)
    mixed, ab = torch.randn(1, channels), torch.randn(1, 4)
    one, fresh = torch.tensor([1]), torch.tensor([False])
    with pytest.raises(ValueError, match="slot outside"):
        gdn_decode(lib, mixed, conv_pool, weight, ab, ab, a_log, dt_bias, ssm_pool, torch.tensor([2]), fresh, 2)
    with pytest.raises(ValueError, match="key heads"):
        gdn_decode(lib, mixed, conv_pool, weight, ab, ab, a_log, dt_bias, ssm_pool, one, fresh, 3)
    with pytest.raises(ValueError, match="states"):
        gdn_decode(lib, mixed, conv_pool, weight, ab, ab, a_log, dt_bias, ssm_pool.double(), one, fresh, 2)
