"""The CPU share of a host layer's missing experts on CUDA (``expert_cpu_share auto``;
engine.layers.moe.cpu_share, share_step): inside the decode CUDA graphs, a side stream
copies the step's rows, ids, weights, live flags and lut to pinned memory, queues the C
job as a host function and copies its sums back, while the fused kernel skips the
CPU's experts (lut -2); the layer's stream joins and adds.

Not yet run on a GPU when written (the CPU tests check the arithmetic: the kernel's
skip in Triton's interpreter, the job against gguf's dequantizer, a shared layer against
the resident one). Here:

1. A tiny Mixtral in Q8_0 (two sparse layers of 4 experts, top-2), the last layer's
   experts in pinned host memory with no slots, the share forced on at even rates:
   decoded in float32, the greedy ids equal the all-resident model's and the logits are
   within the C kernels' rounding (1e-3 of the largest); the counters show CPU runs and
   bus reads.
2. The engine (``--gguf-quantized --cpu-experts 1 --device-limit 8GiB``, the share on):
   greedy ids equal ``--cpu-experts none``'s, decode replayed from CUDA graphs, the
   layer's CPU share non-empty and its counters count CPU runs.
"""

from __future__ import annotations

import gc

import pytest
import torch
from model_checks import engine_greedy, paged_greedy

from kernels.switches import using

gguf = pytest.importorskip("gguf")

from test_moe_offload_blocks_gpu import _prompts, _write  # noqa: E402

from engine.layers.moe.cpu_share import ShareRates  # noqa: E402
from engine.layers.moe.expert_costs import ALWAYS_COPY  # noqa: E402
from engine.layers.moe.offload import offload_experts  # noqa: E402
from engine.loader.gguf_quant import load_gguf_quantized  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
STEPS = 32


def test_a_shared_layer_gives_the_all_resident_greedy_ids(tmp_path, make_tiny_hf_model, paged_runner):
    path, config = _write("mixtral-q8_0", tmp_path, make_tiny_hf_model)
    resident = load_gguf_quantized(config, path, "cuda", torch.float32)
    ref, ref_logits = paged_greedy(paged_runner(resident, config, device="cuda"), _prompts(), STEPS)
    del resident
    hybrid = load_gguf_quantized(config, path, "cpu", torch.float32, experts_in_blocks=True)
    with using(expert_cpu_share="auto"):
        stores, counters = offload_experts(hybrid, config.moe_layers[-1:], 0, ALWAYS_COPY,
                                           device=torch.device("cuda"))
        store = stores[0]
        assert store.cpu_kernels is not None and store.share_rates is not None
        store.share_rates = ShareRates(bus_s=1.0, cpu_s=1.0, cpu_fixed_s=0.0)  # half and half, whatever was measured
        hybrid.to("cuda")
        got, logits = paged_greedy(paged_runner(hybrid, config, device="cuda"), _prompts(), STEPS)
        store.count_bus_reads()
    print(f"\nshare {store.on_cpu} of {config.num_experts}: {counters}")
    assert got == ref
    assert float((logits - ref_logits).abs().max()) <= 1e-3 * max(1.0, float(ref_logits.abs().max()))
    assert store.on_cpu and counters.cpu_runs > 0 and counters.bus_reads > 0
    store._share.check()


def test_the_engine_decodes_in_graphs_with_the_share_and_keeps_the_greedy_ids(tmp_path, make_tiny_hf_model,
                                                                               monkeypatch):
    from engine.common.config import EngineConfig

    path, config = _write("mixtral-q8_0", tmp_path, make_tiny_hf_model)
    monkeypatch.setenv("HEADROOM_CACHE_DIR", str(tmp_path / "cache"))

    def greedy(cpu_experts: str, share: str):
        return engine_greedy(EngineConfig(model=str(path), device="cuda", dtype="float32", gguf_quantized=True,
                                          cpu_experts=cpu_experts, max_running_requests=4, device_limit=8 << 30,
                                          expert_cpu_share=share), _prompts(), 16)

    whole, ref = greedy("none", "off")
    del whole
    gc.collect()
    torch.cuda.empty_cache()
    hybrid, got = greedy("1", "auto")
    assert got == ref
    graphs = hybrid.runner.graphs
    assert graphs is not None and graphs.replays > 0
    store = hybrid.expert_stores[0]
    if store.num_slots < store.num_experts:  # a slot for each of 4 experts leaves nothing to share
        assert store.shares_cpu and store.share_rates is not None
        stats = hybrid.stats()
        assert stats.expert_cache_misses == stats.expert_copies + stats.expert_cpu_runs + stats.expert_bus_reads
        print(f"\nshare rates {store.share_rates}; on the CPU {store.on_cpu}; stats {stats}")
        store._share.check()
