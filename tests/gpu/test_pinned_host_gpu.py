"""Page-locked host memory of exactly a tensor's bytes on a real driver
(engine.layers.pinned_host): registered, copied asynchronously, and unregistered when
freed. (Kernels reading it at the host address: the bus placement of
test_moe_offload_blocks_gpu.py and test_moe_staged_prefill_gpu.py, whose host tiers are
made this way.)"""

from __future__ import annotations

import gc

import torch

from engine.layers.pinned_host import pinned_copy


def test_a_registered_copy_is_pinned_read_over_the_bus_and_released():
    src = torch.randint(0, 255, (157, 1 << 20), dtype=torch.uint8)  # 157 MiB: pin_memory would lock 256
    free_before = torch.cuda.mem_get_info()[0]
    host = pinned_copy(src)
    assert host.is_pinned() and torch.equal(host, src)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    del dev, host
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the device copy's block back from torch's cache
    assert torch.cuda.mem_get_info()[0] >= free_before - (64 << 20)
