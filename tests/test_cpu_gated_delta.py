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


def test_the_device_decode_step_equals_the_reference_and_touches_only_its_slots(tmp_path):
    """GatedDeltaNet._decode, the decode step a CUDA graph holds (states gathered and
    scattered at device-held slots, the batched rule where fla-core is absent), run here
    on CPU tensors: outputs and both pools after three steps equal gdn_decode_ref's, and
    a slot no row names is left as it was."""
    from tiny_hf_parts import tiny_qwen36_config

    from engine.layers.gated_deltanet import GatedDeltaNet

    config = tiny_qwen36_config(tmp_path / "cfg", hidden_size=64, linear_key_head_dim=16, linear_value_head_dim=8)
    layer = GatedDeltaNet(config, 0)
    hk, hv, dk, dv = layer.hk, layer.hv, layer.dk, layer.dv
    gen, channels, conv_pool, ssm_pool, (weight, a_log, dt_bias) = _layer(hk, hv, dk, dv, layer.kernel, 5, seed=7)
    with torch.no_grad():
        layer.conv1d.weight.copy_(weight)
        layer.A_log.copy_(a_log)
        layer.dt_bias.copy_(dt_bias)
    slots = torch.tensor([3, 1, 4])
    ours, ref = (conv_pool.clone(), ssm_pool.clone()), (conv_pool.clone(), ssm_pool.clone())
    for step in range(3):
        mixed = torch.randn(3, channels, generator=gen)
        a, b = torch.randn(3, hv, generator=gen), torch.randn(3, hv, generator=gen)
        want = gdn_decode_ref(mixed, ref[0], weight, a, b, a_log, dt_bias, ref[1], slots,
                              torch.zeros(3, dtype=torch.bool), hk)
        with torch.no_grad():
            got = layer._decode(mixed, b, a, ours[0], ours[1], slots)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (step, float((got - want).abs().max()))
        assert torch.allclose(ours[0], ref[0], rtol=0, atol=1e-6) and torch.allclose(ours[1], ref[1], rtol=1e-4, atol=1e-5)
    assert torch.equal(ours[0][2], conv_pool[2]) and torch.equal(ours[1][0], ssm_pool[0])
