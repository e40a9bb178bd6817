"""A long prefill chunk of a host layer on CUDA with its missing experts staged on the
device (engine.layers.moe.staged_prefill): the same sums as the bus reads' path, the
waves' copies on a side stream, the cache left as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from engine.layers.moe.expert_cache import OffloadedExperts  # noqa: E402
from engine.layers.moe.expert_costs import ALWAYS_COPY  # noqa: E402
from engine.layers.moe.expert_counters import ExpertCounters  # noqa: E402
from engine.layers.moe.expert_stacks import BlockStack  # noqa: E402
from engine.layers.moe.staged_prefill import takes_staging  # noqa: E402
from kernels.moe.reference import route  # noqa: E402
from kernels.quant.synthetic import random_blocks  # noqa: E402
from kernels.switches import using  # noqa: E402

# A Qwen3-30B-A3B layer's expert shape and types, fewer experts.
TYPES, HIDDEN, INTER, EXPERTS, TOP_K = ("Q4_K", "Q4_K", "Q6_K"), 2048, 768, 32, 8


def test_a_staged_chunk_equals_the_bus_reads_on_cuda():
    rng = np.random.default_rng(0)
    gate, up, down = (torch.from_numpy(np.stack([random_blocks(t, r, c, rng, scale=1e-2) for _ in range(EXPERTS)]))
                      for t, r, c in ((TYPES[0], INTER, HIDDEN), (TYPES[1], INTER, HIDDEN), (TYPES[2], HIDDEN, INTER)))
    layer = OffloadedExperts(BlockStack(gate, up, down, TYPES), torch.device("cuda"), 3, ExpertCounters(), ALWAYS_COPY)
    for slot, expert in enumerate((1, 5, 9)):
        layer.cache.copy_in(slot, layer.host, expert)
        layer.slot_of[expert] = slot
    tokens = 512
    assert takes_staging(tokens, TOP_K, EXPERTS)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen), TOP_K, renormalize=True)
    weights, ids = weights.to("cuda", torch.bfloat16), ids.cuda()
    with using(expert_staged_prefill=False):
        bus = layer(x, weights, ids).float()
    assert layer.counters.streamed == 0
    with using(expert_staged_prefill=True):
        staged = layer(x, weights, ids).float()
    torch.cuda.synchronize()
    assert layer.counters.streamed == EXPERTS - 3  # every routed expert but the cached ones, once
    assert dict(layer.slot_of) == {1: 0, 5: 1, 9: 2}
    err = float((staged - bus).abs().max())
    assert err <= 2e-2 * float(bus.abs().max()), err
